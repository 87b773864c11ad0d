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
# The lent GPU image sets CXX=/opt/gcc/bin/g++, whose link pulled parts of a static libstdc++ into _C next to the
# system libstdc++.so that torch loads: a TORCH_CHECK message naming a number then crashed in the mixed copies
# (session 14, H200: segfault in ostream::_M_insert<long>, found with cuda-gdb). Any compiler but the system one
# links with --exclude-libs,ALL, which keeps such copies private to each library (verified there: clean errors).
CXX_BIN=${CXX:-$(command -v g++)}
EXTRA_LINK=""
[ "$(readlink -f "$CXX_BIN")" = "$(readlink -f /usr/bin/g++ 2>/dev/null)" ] || \
  EXTRA_LINK="-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL -DCMAKE_MODULE_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
echo "build.sh: nvcc $NVCC, archs $CUDA_ARCHS, CPU kernels $ISA, $JOBS jobs, C++ $CXX_BIN ($($CXX_BIN -dumpversion))"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DPAGELLM_CUDA_COMPILE_CHECK=OFF \
  -DPython_EXECUTABLE="$(command -v $PY)" -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
  -DCMAKE_CXX_COMPILER="$CXX_BIN" -DCMAKE_CUDA_HOST_COMPILER="$CXX_BIN" $EXTRA_LINK \
  -DPAGELLM_CPU_ISAS="$ISA" -Wno-dev
cmake --build build/gpu -j "$JOBS"
cp -f build/gpu/_C*.so python/pagellm/
# A libstdc++ inserter defined inside our libraries means libstdc++ was linked in statically (see above).
for f in python/pagellm/_C*.so; do
  if nm -D --defined-only "$f" 2>/dev/null | grep -q '_ZNSo9_M_insertIlEERSoT_'; then
    echo "build.sh: WARNING: $f defines libstdc++'s ostream::_M_insert<long>: a static libstdc++ copy (crashes)"
  fi
done
echo "build.sh: built in $(( $(date +%s) - start )) s: $(cd python/pagellm && ls _C*.so | tr '\n' ' ')"
PYTHONPATH=python $PY -c "import pagellm, pagellm._C as C; print('build.sh: import ok; built_with_cuda =', C.built_with_cuda, '; CPU kernels', pagellm.cpu_isa.loaded_cpu_isa())"
