# session 62, after the tier and the table at HEAD ran on an H100 (S62-1..3): an H200 runs c65.sh (or,
# with SHORT=1, c68.sh); any other card does nothing (its table and tests at HEAD are already on record).
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $NAME"
case "$NAME" in *H200*) [ -n "${SHORT:-}" ] && exec bash .device/c68.sh; exec bash .device/c65.sh ;; esac
echo "not an H200: nothing run"
