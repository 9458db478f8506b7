# the next H200 lease (written in session 43): bell1's GPU test and the stop test, then the table twice
set -u; T0=$(date +%s); source .device/gpu-env.sh >/dev/null || exit 1; L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c25.sh $L/; unset KALOS_CAROUSEL
left() { echo $(( 575 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
timeout 150 python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 120 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_crowd.py -k "whole_c_call or stopping" > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -2 $L/tests.txt
for i in 1 2; do
  t=$(left); [ $t -lt 170 ] && break
  timeout $t python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table$i > $L/table$i.txt 2>&1; echo "rc=$?" >> $L/table$i.txt; grep "^| \|rc=" $L/table$i.txt
done
echo "done at $(( $(date +%s) - T0 )) s"
