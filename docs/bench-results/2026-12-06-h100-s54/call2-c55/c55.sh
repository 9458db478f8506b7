# session 53, call 2 (the machine warm from c54.sh): test_gpu_index.py at HEAD unless SKIP_INDEX=1 (c54.sh
# finished it), KCT=4 to run it with KALOS_COMPILE_THREADS=4; then the small namespace's recall
# (scoped_recall.py, 200k rows a namespace, 2k in "small") with the lists and without (KALOS_FILTER_LIST=0)
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c55.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
source .device/gpu-env.sh >/dev/null || exit 1
[ -n "${KCT:-}" ] && export KALOS_COMPILE_THREADS=$KCT
[ -z "${SKIP_INDEX:-}" ] && t=$(left) && timeout $(( t - 150 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 --durations=15 tests/gpu/test_gpu_index.py > $L/index.txt 2>&1; echo "rc=$?" >> $L/index.txt
[ -z "${SKIP_INDEX:-}" ] && echo "index: passed $(grep -c ' PASSED' $L/index.txt), failed $(grep -c ' FAILED\| ERROR' $L/index.txt) at $(( $(date +%s) - T0 )) s"; grep -E " (FAILED|ERROR)" $L/index.txt | head; grep -E "^E " $L/index.txt | head -12; tail -1 $L/index.txt
for fl in 16 0; do
  t=$(left); [ $t -gt 40 ] || break
  KALOS_FILTER_LIST=$fl timeout $(( t - 3 )) python -P benchmarks/scoped_recall.py --device cuda --rows 200000 --calls 2000 --rounds 2 --out $L/scoped_$fl > $L/scoped_$fl.txt 2>&1; echo "rc=$?" >> $L/scoped_$fl.txt
  echo "FILTER_LIST=$fl"; grep "^| \|rc=" $L/scoped_$fl.txt
done
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
