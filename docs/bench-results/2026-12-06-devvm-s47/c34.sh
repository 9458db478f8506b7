# session 47, first call: on an H200 the table at HEAD (c27.sh: durability on, then --no-durable, bell1's and
# the stop tests); on any other card the whole GPU tier and the scoped recalls (c31.sh)
# (c27.sh as recorded in docs/bench-results/2026-12-05-h100-s44-4/, c31.sh in 2026-12-05-devvm-s46/)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then LIM=${LIM:-560} bash .device/c27.sh; else LIM=${LIM:-470} bash .device/c31.sh; fi
