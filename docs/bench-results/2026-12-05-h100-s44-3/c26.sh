# session 44: an H200 or nothing. On an H200: the table twice at HEAD, then bell1's GPU test and the stop test
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c26.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-570}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
grep -q H200 $L/smi.txt || { echo "not an H200: nothing run"; exit 0; }
source .device/gpu-env.sh >/dev/null || exit 1
for i in 1 2; do
  t=$(left); [ $t -lt 185 ] && break
  timeout $t python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table$i > $L/table$i.txt 2>&1; echo "rc=$?" >> $L/table$i.txt; grep "^| \|rc=" $L/table$i.txt
done
t=$(left); [ $t -gt 50 ] && { timeout $t python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 120 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_crowd.py -k "whole_c_call or stopping" > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -2 $L/tests.txt; }
echo "done at $(( $(date +%s) - T0 )) s"
