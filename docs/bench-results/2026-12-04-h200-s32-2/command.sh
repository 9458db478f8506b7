set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c1.sh $L/
python3 -P -c "import kalos_retrievers.sidecar._launch as m, kalos_retrievers.sidecar._hotpath as h; print(\"built\", m.__file__, h.__file__)" > $L/built.txt 2>&1; cat $L/built.txt
for f in index:380 sidecar:70 doorbell:70; do
  n=${f%%:*}; t=${f##*:}
  timeout $t python -P -m pytest -q -p no:cacheprovider --tb=long --durations=8 tests/gpu/test_gpu_$n.py > $L/$n.txt 2>&1; echo "rc=$?" >> $L/$n.txt
  tail -2 $L/$n.txt; pack
done
