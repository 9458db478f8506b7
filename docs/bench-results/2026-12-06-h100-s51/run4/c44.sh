# session 51: KalosMemory.search by phase in scenarios (diag3.py), and memory_search at HEAD without --split
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c44.sh .device/diag3.py $L/; unset KALOS_CAROUSEL
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout 150 python -P .device/diag3.py cuda 600 2>&1 | tee $L/diag3.txt
timeout 40 python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000 2>&1 | tail -1 | tee $L/ms.txt
timeout 40 python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000 --pause-ms 2 2>&1 | tail -1 | tee -a $L/ms.txt
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
