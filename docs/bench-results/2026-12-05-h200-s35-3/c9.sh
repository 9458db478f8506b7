set -u; T0=$(date +%s); source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
cp .device/head.txt $L/head.txt; cp .device/c9.sh $L/
nproc > $L/nproc.txt; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $L/smi.txt 2>&1
timeout 290 python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table > $L/table.txt 2>&1; echo "rc=$?" >> $L/table.txt
tail -22 $L/table.txt; pack
timeout 85 python -P -m pytest -q -p no:cacheprovider --tb=long --durations=5 tests/gpu/test_gpu_sidecar.py > $L/sidecar.txt 2>&1; echo "rc=$?" >> $L/sidecar.txt; tail -2 $L/sidecar.txt; pack
t=$(left); [ $t -gt 30 ] && { timeout $t python -P -m pytest -q -p no:cacheprovider --tb=short --durations=8 --timeout 150 tests/gpu/test_gpu_crowd.py > $L/crowd_tests.txt 2>&1; echo "rc=$?" >> $L/crowd_tests.txt; tail -3 $L/crowd_tests.txt; pack; }
echo "done at $(( $(date +%s) - T0 )) s"
