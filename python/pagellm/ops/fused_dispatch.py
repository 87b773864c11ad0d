"""Which fused CUDA kernels a decode step runs (issue 21: a batch-1 decode step on the GPU is ~11 kernels per layer
of a few microseconds each, and their boundaries cost as much as their work). Each switch is read once at import,
PAGELLM_CUDA_FUSE_<NAME> = 0 or 1 (default 1; another value: ValueError at import); tools/gpu/profile_step.py sets
the module attributes between captures to compare the variants:

- CUDA_FUSE_ROPE_CACHE: the cuda attention backend rotates q / k and writes K / V into the paged cache in one kernel
  (`rotary_embedding_and_cache`) instead of `rotary_embedding` + `reshape_and_cache`;
- CUDA_FUSE_NORM_GEMV: an RMSNorm (with the residual add before it) whose output only feeds a linear that runs
  `linear_gemv` (linear_dispatch: CUDA bf16 / fp16 rows up to CUDA_GEMV_MAX_M) is computed in that GEMV's prologue
  (`rms_norm_linear`): a decoder layer's input and post-attention norms (layers/folded.py);
- CUDA_FUSE_ACT_GEMV: silu_and_mul before such a linear likewise (`silu_and_mul_linear`): the MLP's down projection.

A fourth lives in the C++ glue: PAGELLM_CUDA_FUSE_DECODE_REDUCE (read at every call) lets the decode kernel merge its
flash-decoding splits itself instead of a second kernel. Every fused path gives the bits of the ops it replaces
(tests/ops/test_fused_cuda.py, tests/engine/test_cuda_fusions_engine.py), so a switch changes speed only.
"""

from __future__ import annotations

import os

import torch

try:
    import pagellm.ops as _compiled

    _FUSED_OK = _compiled.ops_available()[0] and torch._C._dispatch_has_kernel_for_dispatch_key(
        "pagellm::rms_norm_linear", "CUDA")
except Exception:  # pragma: no cover - depends on the build
    _FUSED_OK = False


def _switch(name: str) -> bool:
    value = os.environ.get(name, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1" and _FUSED_OK


CUDA_FUSE_ROPE_CACHE = _switch("PAGELLM_CUDA_FUSE_ROPE_CACHE")
CUDA_FUSE_NORM_GEMV = _switch("PAGELLM_CUDA_FUSE_NORM_GEMV")
CUDA_FUSE_ACT_GEMV = _switch("PAGELLM_CUDA_FUSE_ACT_GEMV")
