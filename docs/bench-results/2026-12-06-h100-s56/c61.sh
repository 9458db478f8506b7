# session 56's second lease: 0c29a1d's spread sample (kernels: tau_scores, mma_filter<NT, M, true>) on a GPU:
# test_gpu_index.py (the new test and every batch path), test_gpu_sidecar.py's batch tests, then
# scoped_recall --batch 64 at 500k rows (was: namespace 7.6 ms, namespace+filter 4.9 ms), and --batch 8, lists and masks
set -u; T0=$(date +%s); L=$OUT/s61; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL; LIM=${LIM:-420}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
pack() { (cd $OUT && tar czf s61.tgz s61); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
if grep -q H200 $L/smi.txt; then  # the issue's table first: the spread sample's own tests, then c27.sh (the table at HEAD)
  timeout 120 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 100 tests/gpu/test_gpu_index.py -k "namespace_written or threshold_topk or mma_path" > $L/index.txt 2>&1; echo "rc=$?" >> $L/index.txt
  echo "index (spread): passed $(grep -c ' PASSED' $L/index.txt), failed $(grep -c ' FAILED\| ERROR' $L/index.txt)"; grep -E "^E " $L/index.txt | head -8; pack
  LIM=$(left) bash .device/c27.sh; (cd $OUT && tar czf logs.tgz logs && rm -rf logs); pack; rm -rf $L; exit
fi
t=$(left); timeout $(( t - 170 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 tests/gpu/test_gpu_index.py > $L/index.txt 2>&1; echo "rc=$?" >> $L/index.txt
echo "index: passed $(grep -c ' PASSED' $L/index.txt), failed $(grep -c ' FAILED\| ERROR' $L/index.txt)"; grep -E " (FAILED|ERROR)" $L/index.txt | head; grep -E "^E " $L/index.txt | head -12; tail -1 $L/index.txt; pack
t=$(left); timeout $(( t - 150 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 tests/gpu/test_gpu_sidecar.py -k "batch or cohort or queued or crowd" > $L/side.txt 2>&1; echo "rc=$?" >> $L/side.txt
echo "sidecar batches: passed $(grep -c ' PASSED' $L/side.txt), failed $(grep -c ' FAILED\| ERROR' $L/side.txt)"; grep -E " (FAILED|ERROR)" $L/side.txt | head; tail -1 $L/side.txt; pack
for spec in "16 64" "16 8" "0 8"; do
  set -- $spec; t=$(left); [ $t -gt 55 ] || { echo "no time for FL=$1 B=$2"; break; }
  KALOS_FILTER_LIST=$1 timeout $(( t - 3 )) python -P benchmarks/scoped_recall.py --device cuda --rows 500000 --batch $2 --calls 300 --rounds 2 --out $L/b_$1_$2 > $L/b_$1_$2.txt 2>&1
  echo "FL=$1 B=$2 rc=$? at $(( $(date +%s) - T0 )) s: $(grep -E '^\| [a-z]' $L/b_$1_$2.txt | awk -F'|' '{printf "%s %s/%s; ", $2, $3, $4}')"; pack
done
echo "done at $(( $(date +%s) - T0 )) s"; pack; rm -rf $L
