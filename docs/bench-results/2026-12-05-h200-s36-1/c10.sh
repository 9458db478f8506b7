set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c10.sh $L/
P="timeout 120 python -P benchmarks/carousel_probe.py --rows 1000000 --duration 1.5 --check 100"
$P --return-us 0 --profile --out $L/prof_a > $L/prof_a.txt 2>&1; echo "rc=$?" >> $L/prof_a.txt; grep '^{"return\|^| ' $L/prof_a.txt | cut -c1-1500; pack
KALOS_KERNEL_OPTIONS="-DKALOS_CAR_CLERK=1" $P --return-us 0 --profile --out $L/prof_c > $L/prof_c.txt 2>&1; echo "rc=$?" >> $L/prof_c.txt; grep '^{"return\|^| ' $L/prof_c.txt | cut -c1-1500; pack
KALOS_KERNEL_OPTIONS="-DKALOS_CAR_CLERK=1" timeout 150 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 90 tests/gpu/test_carousel.py > $L/tests_clerk.txt 2>&1; echo "rc=$?" >> $L/tests_clerk.txt; tail -2 $L/tests_clerk.txt; pack
KALOS_KERNEL_OPTIONS="-DKALOS_CAR_CLERK=1" $P --return-us 0,150 --out $L/probe_c > $L/probe_c.txt 2>&1; echo "rc=$?" >> $L/probe_c.txt; grep '^| ' $L/probe_c.txt; pack
$P --return-us 0 --out $L/probe_a > $L/probe_a.txt 2>&1; echo "rc=$?" >> $L/probe_a.txt; grep '^| ' $L/probe_a.txt; pack
timeout 150 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 90 tests/gpu/test_carousel.py > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -2 $L/tests.txt; pack
