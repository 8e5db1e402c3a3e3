#!/bin/bash
# alternate ADASPARK_OUTBOX unset / 1 for the server, default arm and ar, 4 clients over HTTP
ROUNDS=$1
for round in $(seq $ROUNDS); do if [ $((round % 2)) = 1 ]; then ORDER="1 0"; else ORDER="0 1"; fi; for ob in $ORDER; do for arm in adaspark+gate ar; do
  rm -rf /tmp/s22/store
  ADASPARK_OUTBOX=$ob OMP_NUM_THREADS=2 .venv/bin/adaspark serve --arm $arm --parallel 4 --fresh --store /tmp/s22/store --port 8765 > /tmp/s22/serve-ob.log 2>&1 &
  PID=$!
  for i in $(seq 60); do curl -sf localhost:8765/health > /dev/null && break; sleep 1; done
  echo "$round outbox=$ob $arm $(.venv/bin/python docs/results/zen3-s22/drive.py http://127.0.0.1:8765 3 2>&1 | grep 'tok/s' | awk '{printf "%.0f ", $1}')"
  kill -INT $PID; wait $PID
done; done; done
