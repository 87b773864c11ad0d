#!/usr/bin/env bash
# One call on a lent GPU machine (see docs/cuda.md, "Running on a GPU"): build, then every CUDA op test, the
# engine on device="cuda" against HF, and the GPU benchmark, each under its own time limit so that a hang in
# one leaves the others their time. Logs go to $OUT (or /tmp/gpu-out); the last lines printed are a summary.
# Usage (device tool): bash tools/gpu/check.sh [stage ...]   stages: env build prebuilt probe ops graphs engine bench profile
# (default: env build ops engine bench). `build` also leaves the stripped libraries in $OUT/gpu_build.tgz; a
# later call that changed no C++ can carry them in .gpu-build/ (ignored) and run `prebuilt` instead of `build`.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a carried prebuilt _C has the build tree's RPATH, not $ORIGIN: its sibling libraries are found through this
export LD_LIBRARY_PATH=$PWD/python/pagellm${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
STAGES=${*:-env build ops engine bench}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-240} OPS_TIMEOUT=${OPS_TIMEOUT:-150} ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-90}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-120} PYTEST_K=${PYTEST_K:-cuda} GRAPHS_TIMEOUT=${GRAPHS_TIMEOUT:-150}
PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-150}
summary=()
stage() {  # stage NAME TIMEOUT CMD...: runs CMD with its output in $OUT/NAME.log, records rc and seconds
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --signal=KILL "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/$name.log" | cut -c1-160)")
  return $rc
}
# Wheels carried in .whl (pure-Python packages the GPU image lacks: gguf, platformdirs, expecttest).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
for s in $STAGES; do case $s in
  env) stage env 60 bash -c 'nvidia-smi; nvcc --version | tail -1; python3 -c "import sys, sysconfig, torch; print(sys.version); print(\"torch\", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print(\"Python.h:\", sysconfig.get_paths()[\"include\"])"; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400; echo "LDFLAGS=${LDFLAGS:-} CXX=${CXX:-}"; ls -la /usr/bin/g++* $(command -v g++); g++ -dumpspecs | grep -n -i -B1 -A2 "static-libstdc\|lstdc" | head -20; echo env ok' ;;
  build) stage build "$BUILD_TIMEOUT" bash tools/gpu/build.sh || break
         (cd python/pagellm && strip --strip-unneeded _C*.so && tar czf "$OUT/gpu_build.tgz" _C*.so) ;;
  prebuilt) stage prebuilt 60 bash -c 'tar xzf .gpu-build/gpu_build.tgz -C python/pagellm && python3 -c "import pagellm._C as C; print(\"prebuilt: built_with_cuda =\", C.built_with_cuda)"' || break ;;
  ops) stage ops "$OPS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -k "$PYTEST_K" -n 8 --timeout 60 -rf tests/ops ;;
  probe) stage probe 120 python3 tools/gpu/raise_probe.py ;;
  gdb) stage gdb 150 cuda-gdb -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 tools/gpu/raise_probe.py 2 ;;
  graphs) stage graphs "$GRAPHS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rf tests/engine/test_cuda_graphs.py tests/engine/test_cuda_engine.py tests/engine/test_cuda_gemv_engine.py tests/engine/test_cuda_fusions_engine.py ;;
  engine) stage engine "$ENGINE_TIMEOUT" python3 tools/gpu/engine_check.py --out "$OUT" ;;
  bench) stage bench "$BENCH_TIMEOUT" python3 tools/gpu/bench_gpu.py --out "$OUT" ;;
  profile) stage profile "$PROFILE_TIMEOUT" python3 tools/gpu/profile_step.py --out "$OUT" ;;
esac; done
# At most 8 files come back from a device call: every log and JSON also goes into logs.tgz.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude=gpu_build.tgz * 2>/dev/null && \
  find . -maxdepth 1 -type f ! -name logs.tgz ! -name gpu_build.tgz ! -name ops.log ! -name gdb.log -delete)
echo "==== summary"
printf '%s\n' "${summary[@]}"
