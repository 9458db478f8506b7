set -u; source .device/gpu-env.sh || exit 1; L=$OUT/logs; mkdir -p $L; pack() { tar czf $OUT/logs.tgz -C $OUT logs; }
cp .device/head.txt $L/head.txt
timeout 150 python -P -m pytest -q -p no:cacheprovider --tb=long --durations=4 tests/gpu/test_gpu_index.py -k "test_int8_l2_and_filter_against_exact or test_empty_index_namespace_smaller_than_k_and_k_above_rows or test_delete_reinsert_filters_growth_and_compaction or test_out_of_device_memory_is_a_clear_error_and_service_continues" > $L/index_rest.txt 2>&1; echo "rc=$?" >> $L/index_rest.txt
tail -3 $L/index_rest.txt; pack
