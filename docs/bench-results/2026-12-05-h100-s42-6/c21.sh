set -u; T0=$(date +%s); source .device/gpu-env.sh >/dev/null || exit 1; L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c21.sh $L/; unset KALOS_CAROUSEL
left() { echo $(( 265 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
# 1. the stop test as relaxed at 65af4eb (a request written after the epoch turned is not counted), and its control
timeout 120 python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 100 tests/gpu/test_gpu_crowd.py -k stopping > $L/stop_tests.txt 2>&1; echo "rc=$?" >> $L/stop_tests.txt; tail -2 $L/stop_tests.txt
if grep -q H200 $L/smi.txt; then
  t=$(left); timeout $t python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --only copy,kernel,100k,1m --out $L/table > $L/table.txt 2>&1; echo "rc=$?" >> $L/table.txt; grep "^| \|rc=" $L/table.txt
else
  for i in 2 3; do timeout 60 python -P -m pytest -q -p no:cacheprovider --timeout 50 tests/gpu/test_gpu_crowd.py -k stopping > $L/stop_tests_$i.txt 2>&1; echo "rc=$?" >> $L/stop_tests_$i.txt; tail -2 $L/stop_tests_$i.txt; done
  t=$(left); timeout $t python -P benchmarks/gpu_recall.py --only 100k --calls 10000 --out $L/t100k > $L/t100k.txt 2>&1; grep "^| " $L/t100k.txt
fi
echo "done at $(( $(date +%s) - T0 )) s"
