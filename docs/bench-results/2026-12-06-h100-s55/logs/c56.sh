# session 54's next call: first the resident kernel's GPU test files (c56t.sh: session 54's last change, the
# build without lists back to the code before lists, has not run on a GPU); then on an H200 the table at HEAD
# (c27.sh: durable, then --no-durable); on any
# other card where lists pay (gpu-notes Next steps 0 (b) (iii)): scoped_recall.py at --rows 75k..200k
# (151k..402k rows in all) with KALOS_FILTER_LIST 16 and 0, in the order 16 0 0 16 per size
T0=$(date +%s); LIM=${LIM:-560}
LIM=150 bash .device/c56t.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then LIM=$(( LIM - ($(date +%s) - T0) )) bash .device/c27.sh; exit; fi
set -u; L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c56.sh $L/; unset KALOS_CAROUSEL
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
export KALOS_LIST_MIN_ROWS=0  # lists at every size: the sweep looks for the floor (default 2^18 since session 54)
for rows in 75000 100000 150000 200000; do
  i=0
  for fl in 16 0 0 16; do
    i=$((i + 1)); t=$(left); [ $t -gt 45 ] || { echo "no time at $rows"; break 2; }
    KALOS_FILTER_LIST=$fl timeout $(( t - 5 )) python -P benchmarks/scoped_recall.py --device cuda --rows $rows --calls 2000 --rounds 2 --out $L/r${rows}_${fl}_$i > $L/r${rows}_${fl}_$i.txt 2>&1
    echo "rows=$rows FL=$fl #$i rc=$? $(grep -E '^\| (default|small namespace|namespace\+1% filter) ' $L/r${rows}_${fl}_$i.txt | awk -F'|' '{printf "%s %s/%s; ", $2, $3, $4}')"
  done
done
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
