set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
git log --oneline -1 > $L/head.txt 2>&1
timeout 200 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a KALOS_BATCH_TIMING=1 KALOS_PROFILE=$L/prof_a.out --env-b KALOS_PROFILE=$L/prof_b.out --rounds 1 --duration 2 --arena-docs --out $L/ab5 > $L/ab5.txt 2>&1; echo "rc=$?" >> $L/ab5.txt
tail -4 $L/ab5.txt; pack
for s in a b; do
python - $L/prof_$s.out > $L/prof_$s.txt 2>&1 <<'PY'
import pstats, sys
st = pstats.Stats(sys.argv[1])
st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumulative").print_stats(45)
PY
done
head -60 $L/prof_b.txt | tail -52; pack
