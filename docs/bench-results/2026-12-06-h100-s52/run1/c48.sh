# session 52's first lease: on an H200 the table (c27.sh); else the memory store after an add and a pause, then
# the first half of the GPU tier at HEAD (the doorbell files, the carousel, the crowd); c49.sh runs the rest
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash .device/c27.sh; exit; fi
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c48.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
for a in 1 2; do
  timeout 30 python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000 --add-every 1 --pause-ms 2 2>&1 | tail -1 | tee -a $L/ms.txt
done
t=$(left); timeout $(( t - 10 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 --durations=20 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell_spaces.py tests/gpu/test_carousel.py tests/gpu/test_gpu_crowd.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E " (FAILED|ERROR)" $L/tier.txt | head; grep -E "^E " $L/tier.txt | head -12; tail -1 $L/tier.txt
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
