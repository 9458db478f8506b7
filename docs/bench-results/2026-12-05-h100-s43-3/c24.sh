set -u; T0=$(date +%s); source .device/gpu-env.sh >/dev/null || exit 1; L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c24.sh $L/; unset KALOS_CAROUSEL
left() { echo $(( 580 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old .device/old_src > $L/old_install.txt 2>&1 || { echo "old install failed"; tail -5 $L/old_install.txt; }
ls /tmp/site_old/kalos_retrievers/*.so /tmp/site/kalos_retrievers/*.so
# 1. the stop test with the kill control's data (t_dead, given-up times from t0)
for i in 1 2 3; do timeout 60 python -P -m pytest -v -rA -p no:cacheprovider --tb=short --timeout 50 tests/gpu/test_gpu_crowd.py -k stopping > $L/stop_$i.txt 2>&1; echo "rc=$?" >> $L/stop_$i.txt; grep DIAG $L/stop_$i.txt | cut -c1-300; tail -2 $L/stop_$i.txt; done
echo "stop done at $(( $(date +%s) - T0 )) s"
# 2. the library's cost on this host: bell1 (recall) against the Python around recall1 (recall_py)
timeout 90 python -P benchmarks/fastpath_overhead.py --calls 20000 --rounds 3 --out $L > $L/fastpath_overhead.txt 2>&1; tail -1 $L/fastpath_overhead.txt | cut -c1-600
# 3. 100k A/B: de8caad's client (A) against bell1's (B), one sidecar, 8 alternating rounds
timeout 200 python -P benchmarks/ab_clients.py --a /tmp/site_old --b /tmp/site --rows 100000 --rounds 8 --calls 3000 --out $L/ab > $L/ab.txt 2>&1; echo "rc=$?" >> $L/ab.txt; tail -6 $L/ab.txt | cut -c1-400
echo "ab done at $(( $(date +%s) - T0 )) s"
# 4. the table's 100k rows with bell1
t=$(left); grep -q H200 $L/smi.txt && [ $t -gt 200 ] && { timeout 90 python -P benchmarks/gpu_recall.py --only copy,100k --calls 10000 --out $L/t100k > $L/t100k.txt 2>&1; grep "^| " $L/t100k.txt; }
# 5. the resident kernel's tests (bell1 is their client's path now)
t=$(left); timeout $t python -P -m pytest -v -p no:cacheprovider --tb=long --timeout 200 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_sidecar.py > $L/tests.txt 2>&1; echo "rc=$?" >> $L/tests.txt; tail -3 $L/tests.txt
echo "done at $(( $(date +%s) - T0 )) s"
