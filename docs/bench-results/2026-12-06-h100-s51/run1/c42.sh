# session 51's first lease: on an H200 the table (c27), else the starts on idle on GPU (c41)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash .device/c27.sh; else bash .device/c41.sh; fi
