# session 60's H200 call: the table at HEAD (durable), then the GPU tests of the sidecar and the
# index's lists and masks (the rule's test among them), then the --no-durable table if time allows.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c65.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf logs.tgz logs); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $t python -P benchmarks/gpu_recall.py --calls 10000 --out $L/table1 > $L/table1.txt 2>&1; echo "rc=$?" >> $L/table1.txt; grep "^| \|rc=" $L/table1.txt; grep "loaded 1000000\|Traceback\|Error" $L/table1.txt | head -5
echo "table 1 done at $(( $(date +%s) - T0 )) s"; pack
t=$(left); [ $t -gt 90 ] && { timeout $(( t > 200 ? 200 : t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_index.py -k "sidecar or list or mask" > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt
  echo "tests: passed $(grep -c ' PASSED' $L/tests.txt), failed $(grep -c ' FAILED\| ERROR' $L/tests.txt) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $L/tests.txt | head; tail -2 $L/tests.txt; pack; }
t=$(left); [ $t -gt 200 ] && { timeout $(( t - 5 )) python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table2 > $L/table2.txt 2>&1; echo "rc=$?" >> $L/table2.txt; grep "^| \|rc=" $L/table2.txt; }
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
