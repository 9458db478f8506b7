# session 58's plan for the next session's first call (gpu-notes Next steps 0 (b) (iv) and 2): first where a
# listed filter's batch spends its time (list_grid.py, in process: the list's grid scaled, launches
# of fewer queries, ~1 min); then on an H200 the table at HEAD (c27.sh: durable, then --no-durable if time allows); on
# any other card the sidecar file (test_gpu_sidecar.py: not run since the spread sample, d3160aa + 959b20a)
# and batch 64 at 1,005,000 rows with lists and masks (its last figures are S56's, before the spread sample)
set -u; T0=$(date +%s); L=$OUT/s63; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL; LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf s63.tgz s63); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout 150 python -P docs/bench-results/2026-12-06-h100-s58/next/list_grid.py --out $L/list_grid.json > $L/list_grid.txt 2>&1
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
timeout 150 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu/test_gpu_sidecar.py > $L/sidecar.txt 2>&1; echo "rc=$?" >> $L/sidecar.txt
echo "sidecar: passed $(grep -c ' PASSED' $L/sidecar.txt), failed $(grep -c ' FAILED\| ERROR' $L/sidecar.txt) at $(( $(date +%s) - T0 )) s"; pack
for fl in 16 0; do
  t=$(left); [ $t -gt 55 ] || { echo "no time for FL=$fl"; break; }
  KALOS_FILTER_LIST=$fl timeout $(( t - 3 )) python -P benchmarks/scoped_recall.py --device cuda --rows 500000 --batch 64 --calls 300 --rounds 2 --out $L/b_${fl}_64 > $L/b_${fl}_64.txt 2>&1
  echo "FL=$fl B=64 rc=$?: $(grep -E '^\| [a-z]' $L/b_${fl}_64.txt | awk -F'|' '{printf "%s %s/%s; ", $2, $3, $4}')"; pack
done
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
