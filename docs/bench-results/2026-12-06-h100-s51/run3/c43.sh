# session 51: where the time of KalosMemory.search goes after a write and a pause (memory_search --split:
# the kernel's answers and the host's apart), a pause alone, and the embedding alone
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c43.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
python -P -c "
import time, numpy as np
from kalos_retrievers.embeddings import HashingEmbeddings
e = HashingEmbeddings(dim=384); qs = [f'what topic {i % 50} does the user like' for i in range(64)]
t = []
for i in range(3000):
    t0 = time.perf_counter_ns(); e.query(qs[i & 63]); t.append(time.perf_counter_ns() - t0)
print('embedding query p50 %.1f us' % (np.percentile(t[500:], 50) / 1000))" 2>&1 | tee $L/embed.txt
M="python -P benchmarks/memory_search.py --device cuda --memories 20000 --calls 1000"
run() { t=$(left); [ $t -gt 30 ] && { echo "== $*" >> $L/ms.txt; timeout 28 env "$@" >> $L/ms.txt 2>&1; tail -3 $L/ms.txt; }; }
run $M --split
run $M --pause-ms 2 --split
run KALOS_BELL_REARM_MS=1 $M --add-every 1 --pause-ms 2 --split
run KALOS_BELL_REARM_MS=0 $M --add-every 1 --pause-ms 2 --split
run KALOS_BELL_REARM_MS=1 $M --add-every 1 --pause-ms 2
run KALOS_BELL_REARM_MS=1 $M --add-every 1 --pause-ms 2 --split
run KALOS_BELL_REARM_MS=1 $M --add-every 1 --split
run KALOS_BELL_REARM_MS=1 $M --add-every 1 --pause-ms 5 --split
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
