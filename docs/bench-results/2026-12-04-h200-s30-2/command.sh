set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
git log --oneline -1 > $L/head.txt 2>&1
timeout 200 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a KALOS_BATCH_TIMING=1 --env-b KALOS_BATCH_TIMING=1 KALOS_GC=off --rounds 2 --duration 2 --arena-docs --out $L/ab2 > $L/ab2.txt 2>&1; echo "rc=$?" >> $L/ab2.txt
tail -4 $L/ab2.txt; pack
timeout 200 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a KALOS_BATCH_TIMING=1 --env-b KALOS_BATCH_TIMING=1 KALOS_SIDE_RESERVE=128 --rounds 2 --duration 2 --arena-docs --out $L/ab3 > $L/ab3.txt 2>&1; echo "rc=$?" >> $L/ab3.txt
tail -4 $L/ab3.txt; pack
