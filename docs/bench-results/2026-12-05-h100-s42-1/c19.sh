set -u; T0=$(date +%s); source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
left() { echo $(( 570 - ($(date +%s) - T0) )); }
cp .device/head.txt $L/head.txt; cp .device/c19.sh $L/; unset KALOS_CAROUSEL
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $L/smi.txt 2>&1
# 1. 100k A/B, interleaved: A = KALOS_CAROUSEL=0 (the queued batches' carousel off), B = the default (direct)
summ() { python3 -P -c "import json,sys; r=json.load(open(sys.argv[1])); k=r['kalos_100k']; t=r['torch_100k']; s=r['sidecar_100k']; print(sys.argv[2], 'p50', k['p50_us'], 'p99', k['p99_us'], 'torch', t['p50_us'], 'ping', r['ping_100k']['p50_us'], 'served', s['doorbell_served'])" $1 $2; }
for i in 1 2 3 4; do
  for arm in A B; do
    if [ $arm = A ]; then export KALOS_CAROUSEL=0; else unset KALOS_CAROUSEL; fi
    timeout 120 python -P benchmarks/gpu_recall.py --only 100k --calls 5000 --out $L/ab_${arm}$i > $L/ab_${arm}$i.txt 2>&1
    summ $L/ab_${arm}$i/gpu_bench.json $arm$i | tee -a $L/ab.txt
  done
done
unset KALOS_CAROUSEL; pack; echo "A/B done at $(( $(date +%s) - T0 )) s"
# 2. the client's own Python on this host (dev VM: batch 64 ~51 us, batch 1 ~4.3 us)
for b in 1 64; do timeout 90 python -P benchmarks/client_overhead.py --batch $b --calls 20000 > $L/client_overhead_b$b.txt 2>&1; tail -4 $L/client_overhead_b$b.txt; done; pack
# 3. the crowd, sidecar and doorbell tiers at the new code (dispatcher, server stop order, client re-read)
t=$(left); timeout $t python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 200 tests/gpu/test_gpu_crowd.py tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_doorbell.py --durations=10 > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -3 $L/tests.txt; pack
echo "done at $(( $(date +%s) - T0 )) s"
