set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c11.sh $L/
P="timeout 120 python -P benchmarks/carousel_probe.py --rows 1000000 --duration 1.5 --check 100"
export KALOS_KERNEL_OPTIONS="-DKALOS_CAR_CLERK=1 -DKALOS_CAR_SPARE=1"
$P --return-us 0 --profile --out $L/prof_cs > $L/prof_cs.txt 2>&1; echo "rc=$?" >> $L/prof_cs.txt; grep '^{"return\|^| ' $L/prof_cs.txt | cut -c1-2500; pack
$P --return-us 0,150 --out $L/probe_cs > $L/probe_cs.txt 2>&1; echo "rc=$?" >> $L/probe_cs.txt; grep '^| ' $L/probe_cs.txt; pack
timeout 150 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 90 tests/gpu/test_carousel.py > $L/tests_cs.txt 2>&1; echo "rc=$?" >> $L/tests_cs.txt; tail -2 $L/tests_cs.txt; pack
for c in 16 24; do $P --clients $c --return-us 0 --out $L/probe_cs$c > $L/probe_cs$c.txt 2>&1; echo "rc=$?" >> $L/probe_cs$c.txt; grep "^| $c " $L/probe_cs$c.txt; pack; done
timeout 200 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 150 tests/gpu/test_gpu_crowd.py > $L/crowd_cs.txt 2>&1; echo "rc=$?" >> $L/crowd_cs.txt; tail -2 $L/crowd_cs.txt; pack
unset KALOS_KERNEL_OPTIONS
$P --return-us 0 --profile --out $L/prof_a > $L/prof_a.txt 2>&1; echo "rc=$?" >> $L/prof_a.txt; grep '^{"return' $L/prof_a.txt | head -1 | cut -c1-2500; pack
