set -u; T0=$(date +%s); source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
left() { echo $(( 575 - ($(date +%s) - T0) )); }
cp .device/head.txt $L/head.txt; cp .device/c16b.sh $L/
# 1. the table's 1M section with the direct carousel (its 32 processes are the figure; its batch-64 row too)
KALOS_CAROUSEL=direct timeout 280 python -P benchmarks/gpu_recall.py --no-durable --only 1m --calls 10000 --out $L/table_direct > $L/table_direct.txt 2>&1; echo "rc=$?" >> $L/table_direct.txt; grep "^| 1M\|^| 32\|^| \`recall_batch\|rc=" $L/table_direct.txt; pack
# 2. the rest of the GPU suite (session 39 changed the client, the spawn lifeline, the dispatcher's NAMESPACES)
t=$(left); [ $t -gt 60 ] && { timeout $t python -P -m pytest -q -p no:cacheprovider --tb=long --durations=10 --timeout 200 tests/gpu/test_gpu_index.py tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_doorbell.py > $L/gpu_rest.txt 2>&1; echo "rc=$?" >> $L/gpu_rest.txt; tail -4 $L/gpu_rest.txt; pack; }
echo "done at $(( $(date +%s) - T0 )) s"
