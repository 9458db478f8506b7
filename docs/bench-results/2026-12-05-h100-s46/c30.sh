# session 46: the whole GPU tier at HEAD, on whatever card comes; then scoped recalls (namespace, filter) at
# 100k x 768 float16, then the load path over a GpuIndex, profiled
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c30.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-580}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout $(( $(left) - ${KEEP:-90} )) python -P -m pytest -m gpu -q -p no:cacheprovider --timeout 300 tests/gpu > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
grep -E "passed|failed|error|rc=" $L/tier.txt | tail -3; grep -E "^(FAILED|ERROR)" $L/tier.txt | head -20
echo "tier done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt 40 ] && { timeout $t python -P benchmarks/scoped_recall.py --device cuda --rows 100000 --calls 2000 --rounds 2 --out $L > $L/scoped.txt 2>&1; echo "rc=$?" >> $L/scoped.txt; tail -9 $L/scoped.txt; }
echo "scoped done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt 30 ] && { timeout $t python -P benchmarks/load_path.py --index gpu --rows 100000 --rounds 1 --profile 14 > $L/lp.txt 2>&1; echo "rc=$?" >> $L/lp.txt; tail -30 $L/lp.txt; }
echo "done at $(( $(date +%s) - T0 )) s"
