# session 61: whatever card comes does useful work. An H200 runs c65.sh (the table, the tests, the
# non-durable table). Any other card runs the GPU tier at HEAD: the sidecar and crowd tests first
# (session 60's host changes to the start path), then the rest.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c67.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $NAME"
case "$NAME" in *H200*) [ -z "${TIER:-}" ] && exec bash .device/c65.sh ;; esac
LIM=${H100LIM:-$LIM}  # (another card: its own limit, keeping time for an H200 later)
# TIER=1: the tier on any card; T1 (default: the sidecar and crowd files) runs first
T1=${T1:-tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_crowd.py}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf logs.tgz logs); }
t=$(left); timeout $(( t > 230 ? 230 : t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 $T1 > $L/tier1.txt 2>&1; echo "rc=$?" >> $L/tier1.txt
echo "tier1: passed $(grep -c ' PASSED' $L/tier1.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier1.txt) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $L/tier1.txt | head; tail -2 $L/tier1.txt; pack
t=$(left); [ $t -gt 60 ] && { timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu --deselect tests/gpu/test_gpu_sidecar.py --deselect tests/gpu/test_gpu_crowd.py > $L/tier2.txt 2>&1; echo "rc=$?" >> $L/tier2.txt
  echo "tier2: passed $(grep -c ' PASSED' $L/tier2.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier2.txt) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $L/tier2.txt | head; tail -2 $L/tier2.txt; }
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
