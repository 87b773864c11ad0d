#!/usr/bin/env bash
# pagellm vs llama.cpp on the same machine, one server at a time, the same requests and rates.
#
#   bash benchmarks/setup_peer.sh                      # once: .venv-peer (llama-server, llama-cpp-python)
#   bash benchmarks/serving/compare_llamacpp.sh        # RATES, NUM_PROMPTS, SERVERS, TAG, SEED, MIX, PARALLEL, INTERLEAVE override the defaults
#
# Servers (SERVERS picks a subset, space-separated):
#   pagellm-bf16        pagellm serve, the default model (Q4_1 GGUF dequantized) in bfloat16
#   llamacpp-f16        llama.cpp's llama-server on the F16 conversion of the same GGUF (matched precision)
#   llamacpp-q4_1       llama-server on the Q4_1 GGUF itself (its int4 kernels: ~3.5x fewer weight bytes)
#   llamacpp-py-f16     llama-cpp-python's own server (Python, one request at a time) on the F16 GGUF
#   llamacpp-py-q4_1    the same on the Q4_1 GGUF
# Each server gets THREADS compute threads (default: all cores) and PARALLEL sequences (llama-server slots,
# pagellm --max-num-seqs). Results: benchmarks/results/serving-<TAG>/<server>-rate<r>-*.json, a comparison
# PNG and a Markdown table (benchmarks/serving/summarize.py).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PEER="${PEER_VENV:-$ROOT/.venv-peer}"
PY="$ROOT/.venv/bin/python"
RATES="${RATES:-0.25,0.5,1,2}"
NUM_PROMPTS="${NUM_PROMPTS:-60}"
THREADS="${THREADS:-$(nproc)}"
PARALLEL="${PARALLEL:-16}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-2048}"
PORT="${PORT:-8031}"
TAG="${TAG:-$(date +%Y%m%d-%H%M%S)}"
SERVERS="${SERVERS:-pagellm-bf16 llamacpp-f16 llamacpp-q4_1}"
OUT="$ROOT/benchmarks/results/serving-$TAG"
MODELS="$ROOT/benchmarks/models"
PAGELLM_ARGS="${PAGELLM_ARGS:-}"
WARMUP="${WARMUP:-2}"  # requests sent one by one before each rate (pagellm's oneDNN kernels JIT per shape)
SEED="${SEED:-0}"      # request draw: every server gets the same requests at a rate for the same SEED
MIX="${MIX:-mixed}"    # built-in prompt mix: mixed, chat, rag or summarize (bench_serving.py --builtin-mix)
INTERLEAVE="${INTERLEAVE:-0}"  # 1: for each rate, every server in turn (restarting each), instead of server by server
mkdir -p "$OUT"

# The tokenizer of the default model, to count prompt tokens identically for every server.
TOKENIZER="$("$PY" -c "from pagellm.model_loader.default_model import default_model_gguf_path as g; from pagellm.model_loader.gguf_convert import gguf_to_hf_dir as c; print(c(g()))")"

# `exec`, so that the background job's PID is the server itself and `kill` stops it.
start_server() {
  case "$1" in
    pagellm-bf16)
      exec "$ROOT/.venv/bin/pagellm" serve --port "$PORT" --dtype bfloat16 --max-model-len "$MAX_MODEL_LEN" \
        --max-num-seqs "$PARALLEL" $PAGELLM_ARGS ;;
    llamacpp-f16 | llamacpp-q4_1)
      local q=F16 extra=""
      # Q4_1 with weight repacking (the AVX-512/AMX layouts) segfaults while loading on this CPU (llama.cpp
      # 0.3.36's vendored build): run it without repacking.
      [ "$1" = llamacpp-q4_1 ] && q=Q4_1 && extra="--no-repack"
      # -c is shared by the slots: give each slot the full context
      exec "$PEER/bin/llama-server" -m "$MODELS/SmolLM2-135M-Instruct.$q.gguf" --host 127.0.0.1 --port "$PORT" \
        -c $((MAX_MODEL_LEN * PARALLEL)) -np "$PARALLEL" -t "$THREADS" -tb "$THREADS" --no-webui $extra ;;
    llamacpp-py-f16 | llamacpp-py-q4_1)
      local q=F16; [ "$1" = llamacpp-py-q4_1 ] && q=Q4_1
      exec "$PEER/bin/python" -m llama_cpp.server --model "$MODELS/SmolLM2-135M-Instruct.$q.gguf" \
        --host 127.0.0.1 --port "$PORT" --n_ctx "$MAX_MODEL_LEN" --n_threads "$THREADS" ;;
    *) echo "unknown server $1" >&2; return 1 ;;
  esac
}

run_server() {  # run_server SERVER RATES: start it, run bench_serving.py at those rates, stop it
  local server="$1" rates="$2"
  echo "=== $server @ $rates ==="
  if curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1; then
    echo "port $PORT is already serving something: stop it first" >&2
    exit 1
  fi
  start_server "$server" >> "$OUT/$server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null 2>&1 && break
    kill -0 "$pid" 2> /dev/null || { echo "$server exited; see $OUT/$server.log" >&2; exit 1; }
    sleep 1
  done
  echo "serving: $(curl -s "http://127.0.0.1:$PORT/v1/models" | head -c 300)"
  "$PY" benchmarks/bench_serving.py --port "$PORT" --label "$server" --num-prompts "$NUM_PROMPTS" \
    --request-rates "$rates" --max-model-len "$MAX_MODEL_LEN" --tokenizer "$TOKENIZER" \
    --goodput ttft:1000 tpot:100 --warmup "$WARMUP" --seed "$SEED" --builtin-mix "$MIX" --result-dir "$OUT" || true
  kill "$pid" 2> /dev/null || true
  wait "$pid" 2> /dev/null || true
  sleep 2
}

if [ "$INTERLEAVE" = 1 ]; then
  # Rates outer, servers inner: each rate's runs of all servers lie minutes apart, so a slow phase of a shared
  # host (see each result's cpu_steal) hits one rate of every server rather than every rate of one server.
  for rate in ${RATES//,/ }; do
    for server in $SERVERS; do run_server "$server" "$rate"; done
  done
else
  for server in $SERVERS; do run_server "$server" "$RATES"; done
fi

"$PY" benchmarks/bench_serving.py --compare "$OUT"/*-rate*.json --plot "$OUT/compare.png"
"$PY" benchmarks/serving/summarize.py "$OUT" | tee "$OUT/summary.md"
