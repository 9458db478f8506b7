# session 60's last call (a short budget): the table at HEAD without the durable bulk load.
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c66.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-170}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout $(( LIM - ($(date +%s) - T0) )) python -P benchmarks/gpu_recall.py --no-durable --calls 10000 --out $L/table2 > $L/table2.txt 2>&1; echo "rc=$?" >> $L/table2.txt
grep "^| \|rc=" $L/table2.txt; tail -3 $L/table2.txt; echo "done at $(( $(date +%s) - T0 )) s"; (cd $OUT && tar czf logs.tgz logs && rm -rf logs)
