# session 49, the resident kernel serving filters (v1.6): its GPU tests, the namespace and doorbell
# ones (-v), the scoped recalls with filters served and with KALOS_BELL_FILTERS=0 (the A/B), the
# memory store's search both ways, then the rest of the GPU tier while time is left
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c36.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-540}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 60 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell_spaces.py ${BELL_ALL:+tests/gpu/test_gpu_doorbell.py} > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "bell: passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)" $L/bell.txt | head; grep -E "^E " $L/bell.txt | head -30
echo "bell done at $(( $(date +%s) - T0 )) s"
for f in 1 0; do
  t=$(left); [ $t -gt 45 ] && { KALOS_BELL_FILTERS=$f timeout $(( t - 5 )) python -P benchmarks/scoped_recall.py --device cuda --rows 100000 --calls 2000 --rounds 1 --out $L > $L/scoped_f$f.txt 2>&1; echo "rc=$?" >> $L/scoped_f$f.txt; mv $L/scoped_recall.json $L/scoped_recall_f$f.json 2>/dev/null; echo "filters=$f"; grep -E "round|rc=" $L/scoped_f$f.txt | tail -5; }
done
echo "scoped done at $(( $(date +%s) - T0 )) s"
for f in 1 0; do
  t=$(left); [ $t -gt 60 ] && { KALOS_BELL_FILTERS=$f timeout $(( t - 5 )) python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 2000 > $L/memory_f$f.txt 2>&1; echo "rc=$?" >> $L/memory_f$f.txt; echo "filters=$f"; tail -2 $L/memory_f$f.txt; }
done
echo "memory done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt ${TIER_MIN:-60} ] && { timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/gpu --ignore tests/gpu/test_gpu_doorbell_spaces.py --ignore tests/gpu/test_gpu_doorbell.py --ignore tests/gpu/test_gpu_doorbell_filters.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt;
  echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E "passed|failed|rc=" $L/tier.txt | tail -2; grep -E " (FAILED|ERROR)" $L/tier.txt | head -20; }
echo "done at $(( $(date +%s) - T0 )) s"
