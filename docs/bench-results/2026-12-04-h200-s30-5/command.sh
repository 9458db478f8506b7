set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
git log --oneline -1 > $L/head.txt 2>&1
for f in index:235 sidecar:50 doorbell:50; do
  n=${f%%:*}; t=${f##*:}
  timeout $t python -P -m pytest -q -p no:cacheprovider --tb=long --durations=8 tests/gpu/test_gpu_$n.py > $L/$n.txt 2>&1; echo "rc=$?" >> $L/$n.txt
  tail -2 $L/$n.txt; pack
done
mkdir -p /tmp/old && tar xf .device/old.tar -C /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old /tmp/old > $L/old_install.txt 2>&1; echo "install rc=$?"
timeout 150 python -P benchmarks/ab_sidecars.py --a /tmp/site_old --b /tmp/site --rounds 2 --duration 2 --arena-docs --out $L/ab6 > $L/ab6.txt 2>&1; echo "rc=$?" >> $L/ab6.txt
tail -4 $L/ab6.txt; pack
