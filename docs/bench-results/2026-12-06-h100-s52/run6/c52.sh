# session 52: the rest of the GPU tier at b8d98a0: the four crowd tests c51.sh's time cut, then the index and
# the sidecar files (c49.sh)
set -u; T0=$(date +%s); L=$OUT/logs; mkdir -p $L; cp .device/head.txt .device/c52.sh $L/; unset KALOS_CAROUSEL
LIM=${LIM:-250}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/smi.txt; cat $L/smi.txt
source .device/gpu-env.sh >/dev/null || exit 1
C=tests/gpu/test_gpu_crowd.py
timeout 80 python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 70 "$C::test_writes_and_other_recalls_in_a_crowd_on_the_carousel[direct]" "$C::test_without_the_switch_the_carousel_never_starts" "$C::test_stopping_the_sidecar_answers_the_direct_crowd_aboard" > $L/crowd.txt 2>&1; echo "rc=$?" >> $L/crowd.txt
echo "crowd: passed $(grep -c ' PASSED' $L/crowd.txt), failed $(grep -c ' FAILED\| ERROR' $L/crowd.txt)"; tail -1 $L/crowd.txt
t=$(left); timeout $(( t - 5 )) python -P -m pytest -m gpu -v -p no:cacheprovider --timeout 200 --durations=20 tests/gpu/test_gpu_index.py tests/gpu/test_gpu_sidecar.py > $L/tier.txt 2>&1; echo "rc=$?" >> $L/tier.txt
echo "tier: passed $(grep -c ' PASSED' $L/tier.txt), failed $(grep -c ' FAILED\| ERROR' $L/tier.txt)"; grep -E " (FAILED|ERROR)" $L/tier.txt | head; grep -E "^E " $L/tier.txt | head -12; tail -1 $L/tier.txt
echo "done at $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf logs.tgz logs && rm -rf logs
