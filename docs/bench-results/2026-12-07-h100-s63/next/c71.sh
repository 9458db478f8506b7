# session 63, a short budget: on an H200, c68.sh (the --no-durable table at HEAD, then the sidecar's
# GPU tests and the index's lists and masks); on any other card, the GPU tier but the sidecar and
# crowd files (those two passed at f638d45 on an H100, S63-6). LIM caps the whole call.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL
LIM=${LIM:-380}
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $NAME"
case "$NAME" in *H200*) rm -rf $L; exec bash .device/c68.sh ;; esac
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(( LIM - ($(date +%s) - T0) - 5 ))
timeout $t python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu --deselect tests/gpu/test_gpu_sidecar.py --deselect tests/gpu/test_gpu_crowd.py > $L/tier2.txt 2>&1; echo "rc=$?" >> $L/tier2.txt
echo "tier2: passed $(grep -c ' PASSED' $L/tier2.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier2.txt) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $L/tier2.txt | head; tail -2 $L/tier2.txt
(cd $OUT && tar czf logs.tgz logs); rm -rf $L
