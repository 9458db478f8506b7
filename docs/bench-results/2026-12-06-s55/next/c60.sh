# session 56's first call: on an H200 the doorbell files (c56t.sh) then the table at HEAD (c27.sh), via c56.sh;
# on any other card the index and sidecar files, then the 100k A/B of 5a3ec6d against HEAD (c53.sh: does
# 301eb15 take back session 54's ~0.5 µs?). The next call on the warm machine: LIM=560 bash .device/c58.sh
LIM=${LIM:-560}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then LIM=$LIM bash .device/c56.sh; exit; fi
LIM=$LIM bash .device/c53.sh
