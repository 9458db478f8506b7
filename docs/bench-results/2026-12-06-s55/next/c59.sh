# session 55's call on whatever card comes (LIM s in all): on an H200 c56t.sh then the table (c27.sh); else
# c56t.sh (the doorbell files), c57.sh (carousel, crowd), then as much of c56.sh's list-floor sweep as is left
T0=$(date +%s); LIM=${LIM:-520}
left() { echo $(( LIM - ($(date +%s) - T0) )); }
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then LIM=$LIM bash .device/c56.sh; exit; fi
LIM=150 bash .device/c56t.sh
LIM=$(( $(left) < 170 ? $(left) : 170 )) bash .device/c57.sh
t=$(left); [ $t -gt 60 ] && sed '/^LIM=150 bash .device\/c56t.sh$/d; /grep -q H200/d' .device/c56.sh > /tmp/sweep.sh && LIM=$t bash /tmp/sweep.sh
echo "c59 done at $(( $(date +%s) - T0 )) s"
