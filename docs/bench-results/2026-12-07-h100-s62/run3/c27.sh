# session 44: the table at HEAD with durability on (bulk load and reload of 1M, last measured in session 2), on
# whatever card comes; on an H200 also a second table (--no-durable) and bell1's GPU test with the stop test
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c27.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-570}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
df -h /tmp | tail -1
t=$(left); timeout $t python -P benchmarks/gpu_recall.py --calls 10000 --out $L/table1 > $L/table1.txt 2>&1; echo "rc=$?" >> $L/table1.txt; grep "^| \|rc=" $L/table1.txt; grep "loaded 1000000\|Traceback\|Error" $L/table1.txt | head -5
echo "table 1 done at $(( $(date +%s) - T0 )) s"
if grep -q H200 $L/smi.txt; then
  t=$(left); [ $t -gt 185 ] && { timeout $t python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table2 > $L/table2.txt 2>&1; echo "rc=$?" >> $L/table2.txt; grep "^| \|rc=" $L/table2.txt; }
  t=$(left); [ $t -gt 50 ] && { timeout $t python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 120 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_crowd.py -k "whole_c_call or stopping" > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -2 $L/tests.txt; }
fi
echo "done at $(( $(date +%s) - T0 )) s"
