# session 64: on an H200, c65.sh (the table at HEAD with durability, the sidecar and list/mask GPU
# tests, the --no-durable table); on any other card, the doorbell file first (07d239a changed the
# client's recall path, bell1's plan among it, after S64-7), then the files S64-7 did not finish at
# bc6270c: the crowd file (its last 2 not reached) and the index file (31 of 54). LIM caps the call.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $NAME"
case "$NAME" in *H200*) rm -rf $L; exec bash .device/c65.sh ;; esac
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(( LIM - ($(date +%s) - T0) - 5 ))
timeout $t python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 --durations=0 tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_crowd.py tests/gpu/test_gpu_index.py > $L/rest.txt 2>&1; echo "rc=$?" >> $L/rest.txt
echo "rest: passed $(grep -c ' PASSED' $L/rest.txt), failed $(grep -c ' FAILED\| ERROR' $L/rest.txt) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $L/rest.txt | head; tail -2 $L/rest.txt
(cd $OUT && tar czf logs.tgz logs); rm -rf $L
