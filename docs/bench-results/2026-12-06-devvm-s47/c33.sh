# session 47: Kalos against the alternatives on the GPU machine (benchmarks/alternatives.py):
# 100k x 768 (every system that is there), then 1M x 768 (the fast ones)
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c33.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-300}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/extra/faiss_cpu-*.whl || echo "faiss: not installed"
t=$(left); timeout $(( t - 10 )) python -P benchmarks/alternatives.py --rows 100000 --dim 768 --device cuda --calls 5000 --budget-s 10 \
  --only kalos,torch,cupy,numpy,faiss,inmemory --json $L/alt100k.json > $L/alt100k.txt 2>&1; echo "rc=$?" >> $L/alt100k.txt; tail -12 $L/alt100k.txt
t=$(left); [ $t -gt 60 ] && { timeout $(( t - 5 )) python -P benchmarks/alternatives.py --rows 1000000 --dim 768 --device cuda --calls 3000 --budget-s 10 \
  --only kalos,torch,cupy,faiss --json $L/alt1m.json > $L/alt1m.txt 2>&1; echo "rc=$?" >> $L/alt1m.txt; tail -9 $L/alt1m.txt; }
echo "done at $(( $(date +%s) - T0 )) s"
