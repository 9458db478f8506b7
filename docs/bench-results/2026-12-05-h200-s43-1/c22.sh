set -u; T0=$(date +%s); source .device/gpu-env.sh >/dev/null || exit 1; L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c22.sh $L/; unset KALOS_CAROUSEL
left() { echo $(( 575 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $L/smi.txt 2>&1; cat $L/smi.txt
# 1. the stop test as tightened at 00762fc, twice
for i in 1 2; do timeout 90 python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 80 tests/gpu/test_gpu_crowd.py -k stopping > $L/stop_tests_$i.txt 2>&1; echo "rc=$?" >> $L/stop_tests_$i.txt; tail -2 $L/stop_tests_$i.txt; done
echo "stop tests done at $(( $(date +%s) - T0 )) s"
if grep -q H200 $L/smi.txt; then
  for i in 1 2; do
    t=$(left); [ $t -lt 150 ] && break
    timeout $t python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table$i > $L/table$i.txt 2>&1; echo "rc=$?" >> $L/table$i.txt; grep "^| \|rc=" $L/table$i.txt
    echo "table $i done at $(( $(date +%s) - T0 )) s"
  done
else
  timeout 60 python -P benchmarks/client_overhead.py --bell --calls 20000 > $L/client_bell.txt 2>&1; tail -3 $L/client_bell.txt
  t=$(left); timeout $t python -P benchmarks/gpu_recall.py --only copy,kernel,100k --calls 10000 --out $L/t100k > $L/t100k.txt 2>&1; grep "^| " $L/t100k.txt
fi
echo "done at $(( $(date +%s) - T0 )) s"
