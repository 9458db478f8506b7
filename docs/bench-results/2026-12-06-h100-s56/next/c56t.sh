# the resident kernel's GPU test files at HEAD, with the default compile split; logs in $OUT/bell.tgz. Session 54's
# last change (BellSpaces' rows moved last, S.n_rows read where it was before lists) has not run on a GPU
set -u; L=$OUT/bell; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout ${LIM:-200} python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 120 tests/gpu/test_gpu_doorbell_spaces.py tests/gpu/test_gpu_doorbell_filters.py tests/gpu/test_gpu_doorbell.py > $L/bell.txt 2>&1; echo "rc=$?" >> $L/bell.txt
echo "passed $(grep -c ' PASSED' $L/bell.txt), failed $(grep -c ' FAILED\| ERROR' $L/bell.txt)"; grep -E " (FAILED|ERROR)|^E " $L/bell.txt | head -12; tail -2 $L/bell.txt
cd $OUT && tar czf bell.tgz bell && rm -rf bell
