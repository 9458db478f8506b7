# session 51: e63377c (a result's times formatted once) A/B in one lease; a pause's cost in process (torch, embedding)
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c45.sh .device/diag4.py .device/ms_old_iso.py $L/; unset KALOS_CAROUSEL
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
M="--device cuda --memories 20000 --calls 1500"
for r in 1 2; do
  for a in "" "--pause-ms 2" "--add-every 1 --pause-ms 2"; do
    echo "new [$a]: $(timeout 40 python -P benchmarks/memory_search.py $M $a 2>&1 | tail -1)" | tee -a $L/ms.txt
    echo "old [$a]: $(timeout 40 python -P .device/ms_old_iso.py $M $a 2>&1 | tail -1)" | tee -a $L/ms.txt
  done
done
timeout 120 python -P .device/diag4.py 2>&1 | tee $L/diag4.txt
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
