set -u; T0=$(date +%s); source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
left() { echo $(( 580 - ($(date +%s) - T0) )); }
cp .device/head.txt $L/head.txt; cp .device/c12.sh $L/
P="timeout 100 python -P benchmarks/carousel_probe.py --rows 1000000 --duration 1.5 --check 100"
timeout 100 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 90 tests/gpu/test_carousel.py > $L/tests.txt 2>&1; rc=$?; echo "rc=$rc" >> $L/tests.txt; tail -2 $L/tests.txt; pack
[ $rc -eq 0 ] || exit 3
$P --return-us 0,150 --out $L/probe > $L/probe.txt 2>&1; echo "rc=$?" >> $L/probe.txt; grep '^| ' $L/probe.txt; pack
$P --return-us 0 --profile --out $L/prof > $L/prof.txt 2>&1; echo "rc=$?" >> $L/prof.txt; grep '^{"return' $L/prof.txt | head -1 | cut -c1-2600; pack
t=$(left); [ $t -gt 60 ] && { timeout $t python -P -m pytest -q -p no:cacheprovider --tb=short --durations=8 --timeout 150 tests/gpu/test_gpu_crowd.py > $L/crowd.txt 2>&1; echo "rc=$?" >> $L/crowd.txt; tail -3 $L/crowd.txt; pack; }
t=$(left); [ $t -gt 100 ] && { timeout $t python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-b KALOS_CAROUSEL=1 --rounds 2 --duration 2 --arena-docs --out $L/ab_car > $L/ab_car.txt 2>&1; echo "rc=$?" >> $L/ab_car.txt; tail -8 $L/ab_car.txt; pack; }
t=$(left); [ $t -gt 60 ] && { KALOS_KERNEL_OPTIONS="-DKALOS_CAR_CLERK=0" timeout $t python -P -m pytest -x -q -p no:cacheprovider --tb=short --timeout 90 tests/gpu/test_carousel.py > $L/tests_c0.txt 2>&1; echo "rc=$?" >> $L/tests_c0.txt; tail -2 $L/tests_c0.txt; pack; }
echo "done at $(( $(date +%s) - T0 )) s"
