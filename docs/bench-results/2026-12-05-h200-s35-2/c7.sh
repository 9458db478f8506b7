set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c7.sh $L/
timeout 150 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 90 tests/gpu/test_carousel.py > $L/carousel_tests.txt 2>&1; rc=$?; echo "rc=$rc" >> $L/carousel_tests.txt; tail -2 $L/carousel_tests.txt; pack
if [ $rc -eq 0 ]; then
  timeout 100 python -P benchmarks/carousel_probe.py --rows 1000000 --return-us 0,150 --duration 1.5 --out $L/probe > $L/probe.txt 2>&1; echo "rc=$?" >> $L/probe.txt; grep "^| \|grid" $L/probe.txt; pack
  KALOS_KERNEL_OPTIONS="-DKALOS_CAR_SWITCH=0" timeout 100 python -P benchmarks/carousel_probe.py --rows 1000000 --return-us 0 --duration 1.5 --check 100 --out $L/probe_old > $L/probe_old.txt 2>&1; echo "rc=$?" >> $L/probe_old.txt; echo old; grep "^| " $L/probe_old.txt; pack
  for c in 8 16 24; do
    timeout 60 python -P benchmarks/carousel_probe.py --rows 1000000 --clients $c --return-us 0 --duration 1 --check 100 --out $L/probe_c$c > $L/probe_c$c.txt 2>&1; echo "rc=$?" >> $L/probe_c$c.txt; grep "^| $c " $L/probe_c$c.txt; pack
  done
fi
