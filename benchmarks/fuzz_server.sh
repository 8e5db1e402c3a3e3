#!/usr/bin/env bash
# Property-based HTTP fuzzing of a live `adaspark serve` with schemathesis, against the server's
# own /openapi.json, for a bounded time; passes only if no request got a 5xx:
#   bash benchmarks/fuzz_server.sh OUT [SECONDS]      (SECONDS: default 300)
# The server runs the default arm on the embedded model, on a free loopback port, with an API key
# and a temporary learned-store directory (removed afterwards). OUT gets schemathesis.txt (its
# console report), junit.xml, the server's log and exit status, and failures.txt (5xx lines
# from the server log, empty when none). schemathesis goes into the project venv if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: fuzz_server.sh OUT [SECONDS]}
BUDGET=${2:-300}
SCHEMATHESIS=4.32.5
PY=.venv/bin/python

if [ "$(.venv/bin/schemathesis --version 2>/dev/null)" != "schemathesis, version $SCHEMATHESIS" ]; then
  .venv/bin/pip install -q --disable-pip-version-check "schemathesis==$SCHEMATHESIS"
fi
mkdir -p "$OUT"
STORE=$(mktemp -d)
KEY="fuzz-$($PY -c 'import secrets; print(secrets.token_hex(8))')"
PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
BASE="http://127.0.0.1:$PORT"

.venv/bin/adaspark serve --port "$PORT" --api-key "$KEY" --store "$STORE" >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; rm -rf "$STORE"' EXIT
ready() { [ "$(curl -s -o /dev/null -w '%{http_code}' "$BASE/health")" = 200 ]; }
for _ in $(seq 600); do  # a 503 while the model loads would count as a 5xx: wait for it
  ready && break
  kill -0 "$SERVER" 2>/dev/null || { echo "the server died: $OUT/server.log"; exit 1; }
  sleep 1
done
ready || { echo "the model did not load in 10 minutes: $OUT/server.log"; exit 1; }

FROM=$(($(wc -l <"$OUT/server.log") + 1))  # the server log's lines from here on are the fuzz's
set +e
# one worker: requests are served in arrival order anyway, and the machine's cores are shared.
# --request-timeout: a long reply (max_tokens up to the context) must not count as a hang.
.venv/bin/schemathesis run "$BASE/openapi.json" \
  --header "Authorization: Bearer $KEY" \
  --checks not_a_server_error \
  --max-time "$BUDGET" --workers 1 --request-timeout 300 \
  --report junit --report-dir "$OUT" --report-junit-path "$OUT/junit.xml" \
  --output-sanitize true --no-color >"$OUT/schemathesis.txt" 2>&1
FUZZ=$?
set -e
kill "$SERVER" 2>/dev/null || true
STATUS=0
wait "$SERVER" 2>/dev/null || STATUS=$?
echo "server exit status: $STATUS" >>"$OUT/server.log"
for file in "$OUT/server.log" "$OUT/schemathesis.txt" "$OUT/junit.xml"; do
  if [ -f "$file" ]; then sed -i "s/$KEY/<key>/g" "$file"; fi
done
# a 5xx that schemathesis did not see (a stream's error event, an internal error it shrank away)
tail -n "+$FROM" "$OUT/server.log" | grep -E '" 5[0-9][0-9] |internal error|Exception in ASGI' \
  >"$OUT/failures.txt" || true

tail -n 25 "$OUT/schemathesis.txt"
if [ "$FUZZ" != 0 ] || [ -s "$OUT/failures.txt" ]; then
  echo "FAILED: schemathesis exit status $FUZZ, $(wc -l <"$OUT/failures.txt") 5xx lines in the server log"
  exit 1
fi
echo "no 5xx in ${BUDGET}s of fuzzing: $OUT"
