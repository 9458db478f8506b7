set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt
for f in index:330 sidecar:75 doorbell:75; do
  n=${f%%:*}; t=${f##*:}
  timeout $t python -P -m pytest -q -p no:cacheprovider --tb=long --durations=8 tests/gpu/test_gpu_$n.py > $L/$n.txt 2>&1; echo "rc=$?" >> $L/$n.txt
  tail -2 $L/$n.txt; pack
done
