set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt
timeout 200 python -P -m pytest -q -p no:cacheprovider --tb=long -k "queued" tests/gpu/test_gpu_index.py > $L/queued.txt 2>&1; echo "rc=$?" >> $L/queued.txt
tail -2 $L/queued.txt; pack
mkdir -p /tmp/old && tar xf .device/old.tar -C /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old /tmp/old > $L/old_install.txt 2>&1; echo "install rc=$?"
timeout 165 python -P benchmarks/ab_sidecars.py --a /tmp/site_old --b /tmp/site --rounds 2 --duration 2 --arena-docs --out $L/ab3 > $L/ab3.txt 2>&1; echo "rc=$?" >> $L/ab3.txt
tail -4 $L/ab3.txt; pack
T="KALOS_BATCH_TIMING=host"
timeout 165 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a $T KALOS_QUEUE_GRAPH=0 --env-b $T --rounds 2 --duration 2 --arena-docs --out $L/ab4 > $L/ab4.txt 2>&1; echo "rc=$?" >> $L/ab4.txt
tail -4 $L/ab4.txt; pack
