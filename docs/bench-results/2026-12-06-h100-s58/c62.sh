# session 57's first call (gpu-notes "Where issue 3 stands"): the hashed strata of the threshold's sample (after
# 0c29a1d, NOT yet run on a GPU) first: on an H200 its own tests, then the table at HEAD (c27.sh, durable, then
# --no-durable if time allows); on any other card the whole index file, the rest of the tier at HEAD (c56t.sh:
# the doorbell files; c57.sh: the carousel and crowd files), then where a listed scope's batch stops paying
# (gpu-notes Next steps 0 (b) (iv)): scoped_recall --batch 16, 32 at 1,005,000 rows, lists and masks
set -u; T0=$(date +%s); L=$OUT/s62; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL; LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf s62.tgz s62); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
if grep -q H200 $L/smi.txt; then
  (source .device/gpu-env.sh >/dev/null && timeout 150 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu/test_gpu_index.py -k "namespace_written or threshold_topk or mma_path or gemm_and_fused or queued" > $L/index.txt 2>&1; echo "rc=$?" >> $L/index.txt)
  echo "index (spread): passed $(grep -c ' PASSED' $L/index.txt), failed $(grep -c ' FAILED\| ERROR' $L/index.txt)"; pack
  LIM=$(left) bash .device/c27.sh; (cd $OUT && tar czf logs.tgz logs && rm -rf logs); pack; rm -rf $L; exit
fi
(source .device/gpu-env.sh >/dev/null && timeout 200 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 150 tests/gpu/test_gpu_index.py > $L/index.txt 2>&1; echo "rc=$?" >> $L/index.txt)
echo "index: passed $(grep -c ' PASSED' $L/index.txt), failed $(grep -c ' FAILED\| ERROR' $L/index.txt)"; grep -E "^E " $L/index.txt | head -8; pack
LIM=100 bash .device/c56t.sh
LIM=170 bash .device/c57.sh
source .device/gpu-env.sh >/dev/null || exit 1
for spec in "16 16" "0 16" "16 32" "0 32"; do
  set -- $spec; t=$(left); [ $t -gt 55 ] || { echo "no time for FL=$1 B=$2"; break; }
  KALOS_FILTER_LIST=$1 timeout $(( t - 3 )) python -P benchmarks/scoped_recall.py --device cuda --rows 500000 --batch $2 --calls 300 --rounds 2 --out $L/b_$1_$2 > $L/b_$1_$2.txt 2>&1
  echo "FL=$1 B=$2 rc=$? at $(( $(date +%s) - T0 )) s: $(grep -E '^\| [a-z]' $L/b_$1_$2.txt | awk -F'|' '{printf "%s %s/%s; ", $2, $3, $4}')"; pack
done
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
