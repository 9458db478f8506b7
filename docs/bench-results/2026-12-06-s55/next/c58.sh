# session 55: gpu-notes Next steps 0 (b) (iv): recall_batch(64) with a listed filter (fused scans, <= 8 queries a
# launch) against a mask (the GEMM over every row): scoped_recall.py --batch 64 at --rows 500000 (1.005M rows),
# KALOS_FILTER_LIST 16 and 0 in the order 16 0 0 16
set -u; T0=$(date +%s); L=$OUT/bat; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL; LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
i=0
for fl in 16 0 0 16; do
  i=$((i + 1)); t=$(left); [ $t -gt 70 ] || { echo "no time for #$i"; break; }
  KALOS_FILTER_LIST=$fl timeout $(( t - 5 )) python -P benchmarks/scoped_recall.py --device cuda --rows ${ROWS:-500000} --batch 64 --calls 300 --rounds 2 --out $L/b_${fl}_$i > $L/b_${fl}_$i.txt 2>&1
  echo "FL=$fl #$i rc=$? at $(( $(date +%s) - T0 )) s: $(grep -E '^\| [a-z]' $L/b_${fl}_$i.txt | awk -F'|' '{printf "%s %s/%s; ", $2, $3, $4}')"
done
cd $OUT && tar czf bat.tgz bat && rm -rf bat
