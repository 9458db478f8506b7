# session 52: the second half of the GPU tier at HEAD (the index, the sidecar), after c48.sh
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c49.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 10 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 --durations=20 tests/gpu/test_gpu_index.py tests/gpu/test_gpu_sidecar.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E " (FAILED|ERROR)" $L/tier.txt | head; grep -E "^E " $L/tier.txt | head -12; tail -1 $L/tier.txt
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
