# session 49, after the review: the filter tests (the back-off among them), the namespace tests, then the
# memory store's search with 3 and 12 users in turn (filters served), and 12 with KALOS_BELL_FILTERS=0
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c37.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-110}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell_spaces.py > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "bell: passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)" $L/bell.txt | head; grep -E "^E " $L/bell.txt | head -12
echo "bell done at $(( $(date +%s) - T0 )) s"
for run in "1 3" "1 12" "0 12"; do set -- $run
  t=$(left); [ $t -gt 12 ] && { KALOS_BELL_FILTERS=$1 timeout $(( t - 2 )) python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1500 --active $2 > $L/memory_f$1_a$2.txt 2>&1; echo "rc=$?" >> $L/memory_f$1_a$2.txt; echo "filters=$1 active=$2"; tail -2 $L/memory_f$1_a$2.txt; }
done
echo "done at $(( $(date +%s) - T0 )) s"
