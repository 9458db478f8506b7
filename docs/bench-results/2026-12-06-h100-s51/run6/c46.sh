# session 51: which searches after an add and a pause the kernel misses (diag5.py)
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c46.sh .device/diag5.py $L/; unset KALOS_CAROUSEL
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
KALOS_LOG_LEVEL=INFO timeout 200 python -P .device/diag5.py 600 2>&1 | tee $L/diag5.txt
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
