# session 50: the resident kernel restarted after a write once the sidecar is idle (KALOS_BELL_REARM_MS):
# test_gpu_doorbell.py (the new test with its control among them), then the memory store's add + pause +
# search with the restart on and off, alternated
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c40.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-170}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 40 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 120 tests/gpu/test_gpu_doorbell.py > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "bell: passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)" $L/bell.txt | head; grep -E "^E " $L/bell.txt | head -12
echo "bell done at $(( $(date +%s) - T0 )) s"
for r in 1 0 1 0; do
  t=$(left); [ $t -gt 20 ] && { KALOS_BELL_REARM_MS=$r timeout $(( t - 2 )) python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 400 --add-every 1 --pause-ms 2 2>&1 | tail -1 | sed "s/^/rearm=$r: /" | tee -a $L/memory_rearm.txt; }
done
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
