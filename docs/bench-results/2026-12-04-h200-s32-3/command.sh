set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c3.sh $L/
nproc > $L/nproc.txt; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $L/smi.txt 2>&1
timeout 300 python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table > $L/table.txt 2>&1; echo "rc=$?" >> $L/table.txt
tail -25 $L/table.txt; pack
mkdir -p /tmp/old && tar xf .device/old.tar -C /tmp/old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site_old /tmp/old > $L/old_install.txt 2>&1; echo "install rc=$?"
timeout 150 python -P benchmarks/ab_sidecars.py --a /tmp/site_old --b /tmp/site --rounds 2 --duration 2 --arena-docs --out $L/ab3 > $L/ab3.txt 2>&1; echo "rc=$?" >> $L/ab3.txt
tail -4 $L/ab3.txt; pack
