# session 61, a short budget: on an H200, the table at HEAD without the durable bulk load, then the
# sidecar's GPU tests and the index's lists and masks; on any other card, the sidecar and crowd
# tests then the rest of the tier. LIM caps the whole call.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c68.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-400}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf logs.tgz logs); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
tests() {  # $1: log name, rest: pytest arguments
  local f=$L/$1.txt; shift; local t=$(left); [ $t -gt 40 ] || return
  timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 "$@" > $f 2>&1; echo "rc=$?" >> $f
  echo "$(basename $f .txt): passed $(grep -c ' PASSED' $f), failed $(grep -c ' FAILED\| ERROR' $f) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $f | head; tail -2 $f; pack; }
if grep -q H200 $L/smi.txt; then
  t=$(left); timeout $(( t > 200 ? 200 : t - 5 )) python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table2 > $L/table2.txt 2>&1; echo "rc=$?" >> $L/table2.txt
  grep "^| \|rc=" $L/table2.txt; echo "table done at $(( $(date +%s) - T0 )) s"; pack
  tests tests tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_index.py -k "sidecar or list or mask"
else
  tests tier1 tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_crowd.py
  tests tier2 tests/gpu --deselect tests/gpu/test_gpu_sidecar.py --deselect tests/gpu/test_gpu_crowd.py
fi
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
