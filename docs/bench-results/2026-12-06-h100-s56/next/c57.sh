# session 55: the rest of the GPU tier at HEAD that c56t.sh and c53.sh do not run (the carousel and crowd files)
set -u; T0=$(date +%s); L=$OUT/rest; mkdir -p $L; cp .device/head.txt $L/; unset KALOS_CAROUSEL
nvidia-smi --query-gpu=name --format=csv,noheader | tee $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
timeout ${LIM:-300} python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 --durations=10 tests/gpu/test_carousel.py tests/gpu/test_gpu_crowd.py > $L/rest.txt 2>&1; echo "rc=$?" >> $L/rest.txt
echo "rest: passed $(grep -c ' PASSED' $L/rest.txt), failed $(grep -c ' FAILED\| ERROR' $L/rest.txt) at $(( $(date +%s) - T0 )) s"; grep -E " (FAILED|ERROR)|^E " $L/rest.txt | head -12; tail -1 $L/rest.txt
cd $OUT && tar czf rest.tgz rest && rm -rf rest
