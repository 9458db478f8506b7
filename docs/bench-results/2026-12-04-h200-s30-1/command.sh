set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
git log --oneline -1 > $L/head.txt 2>&1; git status --short >> $L/head.txt 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > $L/smi.txt 2>&1
nproc >> $L/smi.txt; python -c "import os; print(sorted(os.sched_getaffinity(0)))" >> $L/smi.txt
timeout 170 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a KALOS_BATCH_TIMING=1 --env-b KALOS_BATCH_TIMING=1 --sidecar-cpus-b 15 --client-cpus-b 0-14 --rounds 2 --duration 2 --arena-docs --out $L/ab1 > $L/ab1.txt 2>&1; echo "rc=$?" >> $L/ab1.txt
tail -4 $L/ab1.txt; pack
for f in index:250 sidecar:60 doorbell:60; do
  n=${f%%:*}; t=${f##*:}
  timeout $t python -P -m pytest -q -p no:cacheprovider --tb=long --durations=12 tests/gpu/test_gpu_$n.py > $L/$n.txt 2>&1; echo "rc=$?" >> $L/$n.txt
  tail -3 $L/$n.txt; pack
done
