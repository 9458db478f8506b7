# session 49's next lease: the doorbell test files at HEAD (9e07e9b on is unrun on a GPU), the memory
# store with 12 users in turn alternating KALOS_BELL_FILTERS=1/0 four times each, then 3 users with an
# add before every search both ways, then the rest of the GPU tier while time is left
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c38.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-540}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 60 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell_spaces.py tests/gpu/test_gpu_doorbell.py > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "bell: passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)" $L/bell.txt | head; grep -E "^E " $L/bell.txt | head -12
echo "bell done at $(( $(date +%s) - T0 )) s"
for f in 0 1 0 1 0 1 0 1; do
  t=$(left); [ $t -gt 30 ] && { KALOS_BELL_FILTERS=$f timeout 25 python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000 --active 12 2>&1 | tail -1 | sed "s/^/filters=$f: /" | tee -a $L/memory_ab12.txt; }
done
for f in 0 1; do
  t=$(left); [ $t -gt 40 ] && { KALOS_BELL_FILTERS=$f timeout 35 python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000 --add-every 1 2>&1 | tail -1 | sed "s/^/filters=$f: /" | tee -a $L/memory_add1.txt; }
done
echo "memory done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt ${TIER_MIN:-60} ] && { timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/gpu --ignore tests/gpu/test_gpu_doorbell_spaces.py --ignore tests/gpu/test_gpu_doorbell.py --ignore tests/gpu/test_gpu_doorbell_filters.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt;
  echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E "passed|failed|rc=" $L/tier.txt | tail -2; grep -E " (FAILED|ERROR)" $L/tier.txt | head -20; }
echo "done at $(( $(date +%s) - T0 )) s"
