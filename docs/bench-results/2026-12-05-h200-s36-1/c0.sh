set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c0.sh $L/
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $L/smi.txt 2>&1
timeout 240 python -P -m pytest -x -q -p no:cacheprovider --tb=long --durations=10 --timeout 90 tests/gpu/test_carousel.py > $L/carousel_tests.txt 2>&1; rc=$?; echo "rc=$rc" >> $L/carousel_tests.txt; tail -3 $L/carousel_tests.txt; pack
if [ $rc -eq 0 ]; then
  timeout 200 python -P benchmarks/carousel_probe.py --rows 1000000 --return-us 0,150,300 --duration 2 --out $L/probe > $L/probe.txt 2>&1; echo "rc=$?" >> $L/probe.txt; tail -12 $L/probe.txt; pack
fi
timeout 120 python -P benchmarks/mma_stages.py --rows 1000000 --batches 16,32 --reps 20 --chain 100 --out $L/mma > $L/mma.txt 2>&1; echo "rc=$?" >> $L/mma.txt; tail -4 $L/mma.txt; pack
