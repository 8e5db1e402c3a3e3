#!/usr/bin/env bash
# The paper's protocol on every arm, llama.cpp included, into one results directory:
#   bash benchmarks/eval_report.sh OUT [CAP] [ARMS]
# llama.cpp (llama-cpp-python built by benchmarks/vs_llamacpp.py --build-only, its server extras
# installed into that venv) serves the same GGUF on the same two threads; it runs first, alone,
# and is stopped before our arms start, so the two never share the cores. Both steps resume:
# rerun the same command after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: eval_report.sh OUT [CAP] [ARMS]}
CAP=${2:-512}
ARMS=${3:-ar,chain3,chain,tree:8,tree:16,cost,adaspark:2,adaspark:4,adaspark:8,adaspark+plain,adaspark+classes,adaspark+gate,adaspark}
PORT=${LLAMACPP_PORT:-8080}
LLAMA_PY=$(cd benchmarks && ../.venv/bin/python -c \
  'from vs_llamacpp import default_venv, venv_python; print(venv_python(default_venv()))')
MODEL=$(.venv/bin/adaspark fetch-model)

mkdir -p "$OUT"
if [ -x "$LLAMA_PY" ]; then
  "$LLAMA_PY" -m pip install -q --disable-pip-version-check uvicorn fastapi sse-starlette \
    "starlette-context<0.4" pydantic-settings PyYAML
  "$LLAMA_PY" -m llama_cpp.server --model "$MODEL" --n_threads 2 --n_threads_batch 2 \
    --n_ctx 8192 --logits_all false --host 127.0.0.1 --port "$PORT" >"$OUT/llamacpp-server.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2>/dev/null || true' EXIT
  for _ in $(seq 120); do  # the model loads in seconds; the harness then checks /v1/models
    curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { echo "llama.cpp server died: $OUT/llamacpp-server.log"; exit 1; }
    sleep 1
  done
  .venv/bin/adaspark bench --arms llamacpp --url "llamacpp=http://127.0.0.1:$PORT" \
    --cap "$CAP" --out "$OUT" --no-progress
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true
  trap - EXIT
else
  echo "llama.cpp not built ($LLAMA_PY missing): run benchmarks/vs_llamacpp.py --build-only first;" \
       "running our arms only"
fi
.venv/bin/adaspark bench --arms "$ARMS" --cap "$CAP" --out "$OUT" --no-progress
.venv/bin/adaspark report "$OUT"
