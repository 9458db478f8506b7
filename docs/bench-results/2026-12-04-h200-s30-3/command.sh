set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
git log --oneline -1 > $L/head.txt 2>&1
timeout 200 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a KALOS_BATCH_TIMING=1 KALOS_PROFILE=$L/prof_a.out --env-b KALOS_PROFILE=$L/prof_b.out --rounds 1 --duration 3 --arena-docs --out $L/ab4 > $L/ab4.txt 2>&1; echo "rc=$?" >> $L/ab4.txt
tail -4 $L/ab4.txt; pack
for s in a b; do
python - $L/prof_$s.out > $L/prof_$s.txt 2>&1 <<'PY'
import pstats, sys
st = pstats.Stats(sys.argv[1])
st.sort_stats("tottime").print_stats(60)
st.sort_stats("cumulative").print_stats(80)
st.sort_stats("cumulative").print_callees("_launch_batch|_launch_behind|launch_slots|_queue_behind|_answer_batch|poll")
PY
done
head -70 $L/prof_b.txt | tail -62; pack
