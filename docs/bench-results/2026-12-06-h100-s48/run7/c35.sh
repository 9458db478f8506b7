# session 48, the resident kernel serving namespaces: its GPU tests and the doorbell's (-v), the scoped
# recalls (namespace against default: S48-1 at 22bb68b on an H100 gave 115.34 / 70.98 us p50), then the
# rest of the GPU tier while time is left
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c35.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-540}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(left); timeout $(( t - 60 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/gpu/test_gpu_doorbell_spaces.py tests/gpu/test_gpu_doorbell.py > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "bell: passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)" $L/bell.txt | head; grep -E "^E " $L/bell.txt | head -30
echo "bell done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt 45 ] && { timeout $(( t - 5 )) python -P benchmarks/scoped_recall.py --device cuda --rows 100000 --calls 2000 --rounds 1 --out $L > $L/scoped.txt 2>&1; echo "rc=$?" >> $L/scoped.txt; tail -8 $L/scoped.txt; }
echo "scoped done at $(( $(date +%s) - T0 )) s"
t=$(left); [ $t -gt 60 ] && { timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 tests/gpu --ignore tests/gpu/test_gpu_doorbell_spaces.py --ignore tests/gpu/test_gpu_doorbell.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt;
  echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E "passed|failed|rc=" $L/tier.txt | tail -2; grep -E " (FAILED|ERROR)" $L/tier.txt | head -20; }
echo "done at $(( $(date +%s) - T0 )) s"
