# session 53, call 1: on an H200 the table (c27.sh); else the GPU tests of session 53's namespace lists (the new
# test, the doorbell spaces file, whose small namespaces now go through lists), then test_gpu_sidecar.py
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash .device/c27.sh; exit; fi
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c54.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-560}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
# the compile split (KALOS_COMPILE_THREADS, default 1 until this runs): a first start's compile, 1 thread and 4
timeout 150 python -P benchmarks/kernel_compile.py --threads 1,4 --out $L/compile > $L/compile.txt 2>&1; rc=$?; echo "rc=$rc" >> $L/compile.txt; cat $L/compile.txt | tail -5
if [ $rc = 0 ]; then export KALOS_COMPILE_THREADS=4; echo "tests with KALOS_COMPILE_THREADS=4"; fi
run() { local name=$1; shift; t=$(left); [ $t -gt 30 ] || { echo "$name: no time"; return; }
  timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 240 --durations=15 "$@" > $L/$name.txt 2>&1; echo "rc=$?" >> $L/$name.txt
  echo "$name: passed $(grep -c ' PASSED' $L/$name.txt), failed $(grep -c ' FAILED\| ERROR' $L/$name.txt) at $(( $(date +%s) - T0 )) s"; grep -E " (FAILED|ERROR)" $L/$name.txt | head; grep -E "^E " $L/$name.txt | head -12; tail -1 $L/$name.txt; }
run ns tests/gpu/test_gpu_doorbell_filters.py -k "small_namespace or selective_filter"
run spaces tests/gpu/test_gpu_doorbell_spaces.py
run sidecar tests/gpu/test_gpu_sidecar.py
run index tests/gpu/test_gpu_index.py
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
