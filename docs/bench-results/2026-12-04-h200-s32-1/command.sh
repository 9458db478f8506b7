set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt; cp .device/c2.sh $L/
python3 -c "import kalos_retrievers.sidecar._launch as m; print('launch built', m.__file__)" > $L/built.txt 2>&1; cat $L/built.txt
timeout 150 python -P -m pytest -q -p no:cacheprovider --tb=long --durations=6 -k "queued" tests/gpu/test_gpu_index.py > $L/queued.txt 2>&1; echo "rc=$?" >> $L/queued.txt
tail -2 $L/queued.txt; pack
timeout 70 python -P -m pytest -q -p no:cacheprovider --tb=long -k "queued or writes_while" tests/gpu/test_gpu_sidecar.py > $L/sidecar_q.txt 2>&1; echo "rc=$?" >> $L/sidecar_q.txt
tail -2 $L/sidecar_q.txt; pack
timeout 140 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a KALOS_QUEUE_C=0 --rounds 2 --duration 2 --arena-docs --out $L/ab1 > $L/ab1.txt 2>&1; echo "rc=$?" >> $L/ab1.txt
tail -4 $L/ab1.txt; pack
T="KALOS_BATCH_TIMING=host"
timeout 140 python -P benchmarks/ab_sidecars.py --a /tmp/site --b /tmp/site --env-a $T KALOS_QUEUE_C=0 --env-b $T --rounds 2 --duration 2 --arena-docs --out $L/ab2 > $L/ab2.txt 2>&1; echo "rc=$?" >> $L/ab2.txt
tail -4 $L/ab2.txt; pack
