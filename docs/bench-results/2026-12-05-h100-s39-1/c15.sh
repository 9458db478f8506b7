set -u; T0=$(date +%s); source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
cp .device/head.txt $L/head.txt; cp .device/c15.sh $L/
# 0. the carousel kernel's own tests (session 38: its poll's acquire fence)
timeout 100 python -P -m pytest -x -q -p no:cacheprovider --tb=long --timeout 90 tests/gpu/test_carousel.py > $L/car_tests.txt 2>&1; echo "rc=$?" >> $L/car_tests.txt; tail -2 $L/car_tests.txt; pack
# 1. the crowd on the carousel, the lane's and the direct clients' (protocol v1.4): exact answers, writes mid-crowd
timeout 260 python -P -m pytest -q -p no:cacheprovider --tb=long --durations=10 --timeout 250 tests/gpu/test_gpu_crowd.py > $L/crowd.txt 2>&1; rc=$?; echo "rc=$rc" >> $L/crowd.txt; tail -3 $L/crowd.txt; pack
AB="python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --duration 2 --arena-docs"
# 2. the queued batches (default) against the direct carousel, 32 processes at 1M rows
t=$(left); [ $t -gt 150 ] && { timeout $t $AB --env-a KALOS_BATCH_TIMING=host --env-b KALOS_CAROUSEL=direct KALOS_BATCH_TIMING=host --rounds 3 --out $L/ab_direct > $L/ab_direct.txt 2>&1; echo "rc=$?" >> $L/ab_direct.txt; tail -9 $L/ab_direct.txt | cut -c1-1500; pack; }
# 3. the acquire fence's cost in process (KALOS_CAR_ACQUIRE=0 drops it), B then A then B
P="python -P benchmarks/carousel_probe.py --rows 1000000 --duration 1.5 --check 100 --return-us 0,150"
for r in 1a 0b 1c; do v=${r:0:1}; t=$(left); [ $t -gt 60 ] && { KALOS_KERNEL_OPTIONS="-DKALOS_CAR_ACQUIRE=$v" timeout 90 $P --out $L/probe_$r > $L/probe_$r.txt 2>&1; echo "rc=$?" >> $L/probe_$r.txt; echo "acquire=$v"; grep '^| 32' $L/probe_$r.txt; pack; }; done
echo "done at $(( $(date +%s) - T0 )) s"
