# session 65: on an H200, c65.sh (the table at HEAD with durability, the sidecar and list/mask GPU
# tests, the --no-durable table); on any other card the files in FILES (default: the doorbell file,
# the sidecar file (serve's make_index and stats changed in session 65), the crowd file, the index file),
# within LIM seconds.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $NAME"
case "$NAME" in *H200*) rm -rf $L; exec bash .device/c65.sh ;; esac
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
t=$(( LIM - ($(date +%s) - T0) - 5 ))
FILES=${FILES:-tests/gpu/test_gpu_doorbell.py tests/gpu/test_gpu_sidecar.py tests/gpu/test_gpu_crowd.py tests/gpu/test_gpu_index.py}
timeout $t python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 --durations=0 $FILES > $L/rest.txt 2>&1; echo "rc=$?" >> $L/rest.txt
echo "rest: passed $(grep -c ' PASSED' $L/rest.txt), failed $(grep -c ' FAILED\| ERROR' $L/rest.txt) at $(( $(date +%s) - T0 )) s"; grep " FAILED\| ERROR" $L/rest.txt | head; tail -2 $L/rest.txt
(cd $OUT && tar czf logs.tgz logs); rm -rf $L
