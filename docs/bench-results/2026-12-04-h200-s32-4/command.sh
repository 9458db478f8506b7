set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c4.sh $L/
T="KALOS_BATCH_TIMING=host"
timeout 170 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a $T --env-b $T --client-env-b KALOS_SPIN_US=50 --rounds 2 --duration 2 --arena-docs --out $L/ab4 > $L/ab4.txt 2>&1; echo "rc=$?" >> $L/ab4.txt
tail -4 $L/ab4.txt; pack
