# session 53's first lease: on an H200 the table (c27.sh); else the rest of the GPU tier that session 52's
# device time did not reach at its lists (the index and sidecar files), then the 100k default recall A/B,
# 5a3ec6d (A, before the lists) against HEAD (B), in the order B A B A (session 52 ran A B and read +0.8 µs)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash .device/c27.sh; exit; fi
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c53.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf logs.tgz logs); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .device/old_src > $L/old_install.txt 2>&1 || { echo "old install failed"; tail -5 $L/old_install.txt; }
t=$(left); timeout $(( t - 110 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 --durations=20 tests/gpu/test_gpu_index.py tests/gpu/test_gpu_sidecar.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E " (FAILED|ERROR)" $L/tier.txt | head; grep -E "^E " $L/tier.txt | head -12; tail -1 $L/tier.txt; pack
summ() { python3 -P -c "import json,sys; r=json.load(open(sys.argv[1])); k=r['kalos_100k']; t=r['torch_100k']; s=r['sidecar_100k']; print(sys.argv[2], 'p50', k['p50_us'], 'p99', k['p99_us'], 'torch', t['p50_us'], 'served', s['doorbell_served'])" $1 $2; }
for i in 1 2; do
  for arm in B A; do
    t=$(left); [ $t -gt 40 ] || break 2
    if [ $arm = A ]; then P=/tmp/site_old:$PYTHONPATH; else P=$PYTHONPATH; fi
    PYTHONPATH=$P timeout $(( t - 3 )) python -P benchmarks/gpu_recall.py --only 100k --calls 5000 --out $L/ab_${arm}$i > $L/ab_${arm}$i.txt 2>&1
    summ $L/ab_${arm}$i/gpu_bench.json $arm$i | tee -a $L/ab.txt
  done
done
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
