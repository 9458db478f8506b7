# session 46, last call: the whole GPU tier at HEAD (after the review's fixes, Dispatcher._one's C answer and
# _pick_up's take of scoped recalls; -v, so a cut run still says what passed), then the scoped recalls
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c31.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-400}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - ${KEEP:-35} )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 300 tests/gpu > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
echo "passed: $(grep -c ' PASSED' $L/tier.txt), failed: $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E "passed|failed|rc=" $L/tier.txt | tail -2; grep -E " (FAILED|ERROR)" $L/tier.txt | head -20
echo "tier done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt 25 ] && { timeout $t python -P benchmarks/scoped_recall.py --device cuda --rows 100000 --calls 2000 --rounds 1 --out $L > $L/scoped.txt 2>&1; echo "rc=$?" >> $L/scoped.txt; tail -8 $L/scoped.txt; }
echo "done at $(( $(date +%s) - T0 )) s"
