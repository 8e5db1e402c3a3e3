#!/bin/bash
# (the health check here takes any HTTP answer, the loading server's 503 included: see README.md)
# alternate GOMP_SPINCOUNT unset / N for the server, default arm and ar, 4 clients over HTTP
N=$1; ROUNDS=$2
for round in $(seq $ROUNDS); do for spin in unset $N; do for arm in adaspark+gate ar; do
  rm -rf /tmp/s22/store
  if [ $spin = unset ]; then env -u GOMP_SPINCOUNT OMP_NUM_THREADS=2 .venv/bin/adaspark serve --arm $arm --parallel 4 --fresh --store /tmp/s22/store --port 8765 > /tmp/s22/serve-spin.log 2>&1 &
  else GOMP_SPINCOUNT=$spin OMP_NUM_THREADS=2 .venv/bin/adaspark serve --arm $arm --parallel 4 --fresh --store /tmp/s22/store --port 8765 > /tmp/s22/serve-spin.log 2>&1 & fi
  PID=$!
  for i in $(seq 60); do curl -s localhost:8765/health > /dev/null && break; sleep 1; done
  echo "$round spin=$spin $arm $(.venv/bin/python docs/results/zen3-s22/drive.py http://127.0.0.1:8765 3 2>&1 | grep 'tok/s' | awk '{printf "%.0f ", $1}')"
  kill -INT $PID; wait $PID
done; done; done
