#!/usr/bin/env bash
# Builds pagellm._C with its CUDA kernels in place (python/pagellm/), on a GPU machine whose python3 already
# has a CUDA torch (the lent H100/H200 machines: torch 2.11 + CUDA 13 on Python 3.12, no package index).
# No pip, no venv: cmake straight into build/gpu, then the libraries are copied beside the Python sources,
# so `PYTHONPATH=python python3 -c "import pagellm"` uses them. Only the CPU kernel library this CPU runs is
# built (PAGELLM_CPU_ISAS), and only for sm_90 unless CUDA_ARCHS says otherwise: a lease is short.
# Usage: bash tools/gpu/build.sh            (from the repository root; JOBS=N to limit parallelism)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
CUDA_ARCHS=${CUDA_ARCHS:-90}
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
ISA=avx512
for f in avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni; do
  [[ " $flags " == *" $f "* ]] || ISA=avx2
done
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
echo "build.sh: python $($PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)')"
echo "build.sh: nvcc $NVCC, archs $CUDA_ARCHS, CPU kernels $ISA, $JOBS jobs"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DPAGELLM_CUDA_COMPILE_CHECK=OFF \
  -DPython_EXECUTABLE="$(command -v $PY)" -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
  -DPAGELLM_CPU_ISAS="$ISA" -Wno-dev
cmake --build build/gpu -j "$JOBS"
cp -f build/gpu/_C*.so python/pagellm/
echo "build.sh: built in $(( $(date +%s) - start )) s: $(cd python/pagellm && ls _C*.so | tr '\n' ' ')"
PYTHONPATH=python $PY -c "import pagellm, pagellm._C as C; print('build.sh: import ok; built_with_cuda =', C.built_with_cuda, '; CPU kernels', pagellm.cpu_isa.loaded_cpu_isa())"
