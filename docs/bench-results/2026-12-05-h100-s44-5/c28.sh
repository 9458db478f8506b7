# session 44: the start-up reload and the bulk load after their trims (sidecar/service.py, store.py, index.py):
# 1M with durability at HEAD; then 31fe66c (old) against HEAD at 200k rows, the same lease
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c28.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-200}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout 45 python -P -m pytest -q -p no:cacheprovider --timeout 40 tests/gpu/test_gpu_sidecar.py -k "reloads or memory_limit or float16_default" > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -2 $L/tests.txt
t=$(left); timeout $t python -P benchmarks/gpu_recall.py --only durable --out $L/d1m > $L/d1m.txt 2>&1; echo "rc=$?" >> $L/d1m.txt; grep "^| \|rc=\|Error" $L/d1m.txt
echo "1M done at $(( $(date +%s) - T0 )) s"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .device/old_src > $L/old_install.txt 2>&1 || echo "old install failed"
for v in old new; do
  t=$(left); [ $t -lt 40 ] && break
  if [ $v = old ]; then P=/tmp/site_old:$PYTHONPATH; else P=$PYTHONPATH; fi
  PYTHONPATH=$P timeout $t python -P benchmarks/gpu_recall.py --only durable --rows-1m 200000 --out $L/d200k_$v > $L/d200k_$v.txt 2>&1; echo "rc=$?" >> $L/d200k_$v.txt; echo "== $v"; grep "^| [bsa]\|rc=\|Error" $L/d200k_$v.txt
done
echo "done at $(( $(date +%s) - T0 )) s"
