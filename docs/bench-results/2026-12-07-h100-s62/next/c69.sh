# session 62: the tier passed at HEAD on an H100 (S62-1/2). Next: on an H200, c65.sh (the table at HEAD,
# the tests, the non-durable table); on any other card, the table at HEAD (c27.sh, durable) under H100LIM.
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $NAME"
mkdir -p $OUT/logs; cp .device/c69.sh $OUT/logs/
case "$NAME" in *H200*) exec bash .device/c65.sh ;; esac
LIM=${H100LIM:-430} exec bash .device/c27.sh
