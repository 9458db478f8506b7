# session 50: rows kept in L2 between scans (KALOS_L2_KEEP_MB: the first MB of rows evict_normal or
# evict_last, every later row evict_first), in process with the resident kernel: 100k float16 rows,
# five builds alternated twice, then 1M with the base and the best 100k build alternated
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c39.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
P="python -P benchmarks/doorbell_probe.py --modes 7 --calls 3000"
declare -A OPT=([base]="" [n24]="-DKALOS_L2_KEEP_MB=24" [n32]="-DKALOS_L2_KEEP_MB=32" [n40]="-DKALOS_L2_KEEP_MB=40" [l32]="-DKALOS_L2_KEEP_MB=32 -DKALOS_L2_KEEP_HINT=1")
for round in 1 2; do for v in base n24 n32 n40 l32; do
  t=$(left); [ $t -gt 60 ] && { KALOS_KERNEL_OPTIONS="${OPT[$v]}" timeout 100 $P --rows 100000 --out $L/p_${v}_$round > $L/p_${v}_$round.txt 2>&1; echo "rc=$?" >> $L/p_${v}_$round.txt; python -P .device/summ.py $L/p_${v}_$round.txt || tail -3 $L/p_${v}_$round.txt; }
done; echo "round $round done at $(( $(date +%s) - T0 )) s"; done
best=$(python -P - $L <<'PY'
import json, sys, glob, collections
d = collections.defaultdict(list)
for f in glob.glob(sys.argv[1] + "/p_*_*.txt"):
    v = f.split("/")[-1].split("_")[1]
    for line in open(f):
        if line.startswith("{"):
            d[v].append(json.loads(line)["modes"]["7"]["kernel_us"]["scan_merge"]["p50"])
m = {v: sum(x) / len(x) for v, x in d.items() if x and v != "base"}
print(min(m, key=m.get) if m else "n32")
PY
)
echo "best at 100k: $best"
for round in 1 2; do for v in base $best; do
  t=$(left); [ $t -gt 75 ] && { KALOS_KERNEL_OPTIONS="${OPT[$v]}" timeout $(( t - 5 )) $P --rows 1000000 --calls 2000 --out $L/m_${v}_$round > $L/m_${v}_$round.txt 2>&1; echo "rc=$?" >> $L/m_${v}_$round.txt; python -P .device/summ.py $L/m_${v}_$round.txt || tail -3 $L/m_${v}_$round.txt; }
done; done
echo "done at $(( $(date +%s) - T0 )) s"
