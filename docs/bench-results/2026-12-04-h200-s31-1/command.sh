set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; nproc > $L/nproc.txt; lscpu > $L/lscpu.txt 2>&1
timeout 150 python -P -m pytest -q -p no:cacheprovider --tb=long -k "queued" tests/gpu/test_gpu_index.py > $L/queued.txt 2>&1; echo "rc=$?" >> $L/queued.txt
tail -2 $L/queued.txt; pack
mkdir -p /tmp/old && tar xf .device/old.tar -C /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old /tmp/old > $L/old_install.txt 2>&1; echo "install rc=$?"
T="KALOS_BATCH_TIMING=1"
timeout 170 python -P benchmarks/ab_sidecars.py --a /tmp/site_old --b /tmp/site --env-a $T --env-b $T --rounds 2 --duration 2 --arena-docs --out $L/ab1 > $L/ab1.txt 2>&1; echo "rc=$?" >> $L/ab1.txt
tail -4 $L/ab1.txt; pack
timeout 170 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a $T --env-b $T --sidecar-cpus-b 15 --client-cpus-b 0-14 --rounds 2 --duration 2 --arena-docs --out $L/ab2 > $L/ab2.txt 2>&1; echo "rc=$?" >> $L/ab2.txt
tail -4 $L/ab2.txt; pack
