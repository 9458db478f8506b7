# session 50's next lease: the starts on idle as of d97301f (a lone recall, then an idle ms, starts
# the kernel; restarts after writes until two fruitless runs): test_gpu_doorbell.py (its agent test now with
# three users' filters), the filter and namespace files, then the memory store's add + 2 ms pause + search
# with KALOS_BELL_REARM_MS=1 and 0 alternated (1,000 calls: the first second is the back-off after the first,
# unserved, filter), then the rest of the tier
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c41.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 60 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell_spaces.py > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "bell: passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)" $L/bell.txt | head; grep -E "^E " $L/bell.txt | head -12
echo "bell done at $(( $(date +%s) - T0 )) s"
for r in 1 0 1 0; do
  t=$(left); [ $t -gt 30 ] && { KALOS_BELL_REARM_MS=$r timeout 28 python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000 --add-every 1 --pause-ms 2 2>&1 | tail -1 | sed "s/^/rearm=$r: /" | tee -a $L/memory_rearm.txt; }
done
echo "memory done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt ${TIER_MIN:-60} ] && { timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/gpu --ignore tests/gpu/test_gpu_doorbell_spaces.py --ignore tests/gpu/test_gpu_doorbell.py --ignore tests/gpu/test_gpu_doorbell_filters.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt;
  echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E "passed|failed|rc=" $L/tier.txt | tail -2; grep -E " (FAILED|ERROR)" $L/tier.txt | head -20; }
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
