# session 52: after b8d98a0 (the resident kernel's lists build only while a list is served): the 100k
# default recall A/B, 5a3ec6d (A) against HEAD (B), three pairs; the list tests of the index; the doorbell
# files, the carousel and the crowd (c49.sh runs the index and sidecar files); scoped_recall with lists
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c51.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf logs.tgz logs); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .device/old_src > $L/old_install.txt 2>&1 || { echo "old install failed"; tail -5 $L/old_install.txt; }
summ() { python3 -P -c "import json,sys; r=json.load(open(sys.argv[1])); k=r['kalos_100k']; t=r['torch_100k']; s=r['sidecar_100k']; print(sys.argv[2], 'p50', k['p50_us'], 'p99', k['p99_us'], 'torch', t['p50_us'], 'served', s['doorbell_served'])" $1 $2; }
for i in 1 2 3; do
  for arm in A B; do
    if [ $arm = A ]; then P=/tmp/site_old:$PYTHONPATH; else P=$PYTHONPATH; fi
    PYTHONPATH=$P timeout 90 python -P benchmarks/gpu_recall.py --only 100k --calls 5000 --out $L/ab_${arm}$i > $L/ab_${arm}$i.txt 2>&1
    summ $L/ab_${arm}$i/gpu_bench.json $arm$i | tee -a $L/ab.txt
  done
done
echo "A/B done at $(( $(date +%s) - T0 )) s"; pack
timeout 100 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 90 tests/gpu/test_gpu_index.py -k "selective or kept" > $L/t_index.txt 2>&1; echo "rc=$?" >> $L/t_index.txt
echo "index lists: passed $(grep -c ' PASSED' $L/t_index.txt), failed $(grep -c ' FAILED\| ERROR' $L/t_index.txt)"; grep -E "^E " $L/t_index.txt | head -8; tail -1 $L/t_index.txt; pack
t=$(left); timeout $(( t - 80 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 --durations=20 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell_spaces.py tests/gpu/test_carousel.py tests/gpu/test_gpu_crowd.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E " (FAILED|ERROR)" $L/tier.txt | head; grep -E "^E " $L/tier.txt | head -12; tail -1 $L/tier.txt; pack
t=$(left); [ $t -gt 75 ] && { timeout $(( t - 3 )) python -P benchmarks/scoped_recall.py --device cuda --rows 500000 --calls 2000 --rounds 2 --out $L/scoped_16 > $L/scoped_16.txt 2>&1; echo "rc=$?" >> $L/scoped_16.txt; grep "^| \|rc=\|Error\|1% filter" $L/scoped_16.txt; }
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
