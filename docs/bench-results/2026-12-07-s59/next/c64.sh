# session 59's call (gpu-notes Next steps 0 (b) (iv) and 2): session 58's c63.sh with session 59's rule
# (list_pays, KALOS_LIST_LAUNCH_ROWS) off where a list is what is timed, then on where it is the question.
# 1. list_grid.py (rule off): where a listed batch spends its time, in process, ~1 min.
# 2. On an H200: the table at HEAD (c27.sh: durable, then --no-durable if time allows); with TABLE_FIRST=1 (a
#    short lease) the table alone.
# 3. On any other card: test_gpu_sidecar.py (not run since the spread sample) and test_gpu_index.py's list
#    tests (the rule's own among them); then batch 64 at 1,005,000 rows: the rule on (the 1% filter should
#    take its mask), masks (FL=0), lists (FL=16, rule off).
set -u; T0=$(date +%s); L=$OUT/s64; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL; LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf s64.tgz s64); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
if [ -n "${TABLE_FIRST:-}" ] && grep -q H200 $L/smi.txt; then  # a short lease on an H200: the table before all else
  LIM=$(( $(left) - 5 )) bash .device/c27.sh; (cd $OUT && tar czf logs.tgz logs && rm -rf logs); pack; exit
fi
KALOS_LIST_LAUNCH_ROWS=0 timeout 150 python -P docs/bench-results/2026-12-06-h100-s58/next/list_grid.py --out $L/list_grid.json > $L/list_grid.txt 2>&1
echo "list_grid rc=$? at $(( $(date +%s) - T0 )) s"; grep -m3 "loaded\|Error" $L/list_grid.txt
python -P -c "
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r['case'], 'b', r['batch'], 'x', r['scale'], 'q', r['fused_max_q'], 'fl', r['filter_list'], 'grid', r['grid'],
          'p50', round(r['p50_us'], 1), 'p90', round(r['p90_us'], 1), 'n', r['launches'], 'dev', r['device_us'],
          '' if r['same_as_first'] else 'DIFFERS %d %.2g' % (r['queries_same_rows'], r['max_score_gap']))
" $L/list_grid.json; pack
if grep -q H200 $L/smi.txt; then
  LIM=$(left) bash .device/c27.sh; (cd $OUT && tar czf logs.tgz logs && rm -rf logs); pack; exit
fi
timeout 200 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu/test_gpu_sidecar.py \
  tests/gpu/test_gpu_index.py -k "sidecar or list or mask" > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt
echo "tests: passed $(grep -c ' PASSED' $L/tests.txt), failed $(grep -c ' FAILED\| ERROR' $L/tests.txt) at $(( $(date +%s) - T0 )) s"
grep " FAILED\| ERROR" $L/tests.txt | head; tail -3 $L/tests.txt; pack
for case in rule 0 16; do
  t=$(left); [ $t -gt 55 ] || { echo "no time for $case"; break; }
  if [ $case = rule ]; then env=(env -u KALOS_LIST_LAUNCH_ROWS KALOS_FILTER_LIST=16); else env=(env KALOS_LIST_LAUNCH_ROWS=0 KALOS_FILTER_LIST=$case); fi
  "${env[@]}" timeout $(( t - 3 )) python -P benchmarks/scoped_recall.py --device cuda --rows 500000 --batch 64 --calls 300 --rounds 2 --out $L/b_${case}_64 > $L/b_${case}_64.txt 2>&1
  echo "$case B=64 rc=$?: $(grep -E '^\| [a-z]' $L/b_${case}_64.txt | awk -F'|' '{printf "%s %s/%s; ", $2, $3, $4}')"; pack
done
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
