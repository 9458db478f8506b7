# session 52: the filters' lists of rows (scan_list, the resident kernel's NS_LIST scopes): their GPU
# tests, scoped_recall at 500k rows a namespace with lists (default) and masks (KALOS_FILTER_LIST=0),
# and the 100k default recall A/B: 5a3ec6d (A, before the lists) against HEAD (B)
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c50.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf logs.tgz logs); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .device/old_src > $L/old_install.txt 2>&1 || { echo "old install failed"; tail -5 $L/old_install.txt; }
timeout 150 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 140 --durations=10 tests/gpu/test_gpu_index.py -k "selective or kept" > $L/t_index.txt 2>&1; echo "rc=$?" >> $L/t_index.txt
echo "index: passed $(grep -c ' PASSED' $L/t_index.txt), failed $(grep -c ' FAILED\| ERROR' $L/t_index.txt)"; grep -E "^E " $L/t_index.txt | head -8; tail -1 $L/t_index.txt
timeout 200 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 190 --durations=10 tests/gpu/test_gpu_doorbell_filters.py > $L/t_filters.txt 2>&1; echo "rc=$?" >> $L/t_filters.txt
echo "filters: passed $(grep -c ' PASSED' $L/t_filters.txt), failed $(grep -c ' FAILED\| ERROR' $L/t_filters.txt)"; grep -E "^E " $L/t_filters.txt | head -8; tail -1 $L/t_filters.txt
echo "tests done at $(( $(date +%s) - T0 )) s"; pack
for fl in 16 0; do
  t=$(left); [ $t -gt 130 ] || break
  KALOS_FILTER_LIST=$fl timeout 150 python -P benchmarks/scoped_recall.py --device cuda --rows 500000 --calls 2000 --rounds 2 --out $L/scoped_$fl > $L/scoped_$fl.txt 2>&1; echo "rc=$?" >> $L/scoped_$fl.txt
  echo "KALOS_FILTER_LIST=$fl"; grep "^| \|rc=\|Error" $L/scoped_$fl.txt; grep "1% filter" $L/scoped_$fl.txt | head -2
done
echo "scoped done at $(( $(date +%s) - T0 )) s"; pack
summ() { python3 -P -c "import json,sys; r=json.load(open(sys.argv[1])); k=r['kalos_100k']; t=r['torch_100k']; s=r['sidecar_100k']; print(sys.argv[2], 'p50', k['p50_us'], 'p99', k['p99_us'], 'torch', t['p50_us'], 'served', s['doorbell_served'])" $1 $2; }
for i in 1 2; do
  for arm in A B; do
    t=$(left); [ $t -gt 45 ] || break 2
    if [ $arm = A ]; then P=/tmp/site_old:$PYTHONPATH; else P=$PYTHONPATH; fi
    PYTHONPATH=$P timeout $(( t - 5 )) python -P benchmarks/gpu_recall.py --only 100k --calls 5000 --out $L/ab_${arm}$i > $L/ab_${arm}$i.txt 2>&1
    summ $L/ab_${arm}$i/gpu_bench.json $arm$i | tee -a $L/ab.txt
  done
done
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
