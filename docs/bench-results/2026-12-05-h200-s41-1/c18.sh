set -u; T0=$(date +%s); source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
cp .device/head.txt $L/head.txt; cp .device/c18.sh $L/; unset KALOS_CAROUSEL
# 1. the tests at session 40's default (the carousel direct unless KALOS_CAROUSEL=0): the crowd's new
#    "default" case and its control at 0, the sidecar's queued-batch crowds at 0, the switch refused by name
timeout 200 python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 150 tests/gpu/test_gpu_crowd.py tests/gpu/test_gpu_sidecar.py "tests/integration/test_cli.py::test_an_unknown_carousel_switch_exits_2_naming_it" -k "default or without_the_switch or float16_cohorts or writes_while_a_float16 or unknown_carousel" > $L/default_tests.txt 2>&1; echo "rc=$?" >> $L/default_tests.txt; grep "passed\|failed\|rc=" $L/default_tests.txt | tail -3; pack
# 2. the whole table as built (no switch set: direct)
t=$(left); [ $t -gt 200 ] && { timeout $t python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table > $L/table.txt 2>&1; echo "rc=$?" >> $L/table.txt; grep "^| \|rc=" $L/table.txt; pack; }
echo "done at $(( $(date +%s) - T0 )) s"
