"""Which kernel a dense (unquantized) linear runs on: pagellm's own CPU kernels for bf16 and fp32 rows, its CUDA
GEMV for a few bf16 / fp16 rows, else F.linear. Used by the unquantized LinearMethod and the LM head."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import pagellm.ops as _compiled

    _SMALL_M_OK = _compiled.ops_available()[0]
    _linear_small_m = torch.ops.pagellm.linear_small_m.default if _SMALL_M_OK else None
    _linear_argmax = torch.ops.pagellm.linear_argmax.default if _SMALL_M_OK else None
    _AMX_OK = _SMALL_M_OK and _compiled.amx_available()
    _linear_amx = torch.ops.pagellm.linear_amx.default if _AMX_OK else None
    # a CUDA build registers the GEMVs (gemv_cuda.cuh, gemv_split_cuda.cuh) for the CUDA dispatch key
    _CUDA_GEMV_OK = _SMALL_M_OK and torch._C._dispatch_has_kernel_for_dispatch_key("pagellm::linear_gemv", "CUDA")
    _linear_gemv = torch.ops.pagellm.linear_gemv.default if _CUDA_GEMV_OK else None
except Exception:  # pragma: no cover - depends on the build
    _SMALL_M_OK = _AMX_OK = _CUDA_GEMV_OK = False
    _linear_gemv = None

# Which kernel a bf16 CPU linear of M (flattened) rows runs (the one place this is decided; decode steps
# replayed from a step graph replay the choice made here). Measured on the AMX dev machine:
#   - torch.ops.pagellm.linear_small_m streams the weight once (AVX512-BF16): ~2-3x F.linear at M = 1-2;
#   - torch.ops.pagellm.linear_amx (AMX tiles) wins from M = 3 to 64, 1.2-2x oneDNN's bf16 GEMM, 1.1-1.4x
#     at 128-256 on the wide shapes (gate/up, the LM head) and about even on the others;
#   - beyond that (prefill chunks) torch's GEMM (oneDNN) is as fast or faster.
# On a CPU without AMX every bf16 row goes through linear_small_m, whatever M: its (row, output) dot products
# round the same for every M (one K order, one lane reduction; M only decides weight reuse), so a token's
# logits do not depend on what else shares the step (batch invariance: speculative verify rows of 1 + k
# tokens and prefill chunks give the bits plain decode gives). Since its rows are blocked by 64 (x stays in
# L2) it is within ~10 % of oneDNN's bf16 GEMM at M = 32-512 and 2-8x faster at M <= 16 (session 9, Xeon
# without AMX, 2048 x 2048 and 8192 x 2048 weights). With AMX, rows 3-256 take AMX tiles, whose rounding
# differs from linear_small_m's: bf16 batch invariance there is still to do.
#
# fp32 (session 13): every fp32 CPU row goes through linear_small_m, whatever M and whatever the CPU (AMX has
# no fp32 tiles), for the same batch invariance (its fp32 FMA tiles: one 16-lane accumulator per output, K in
# order, vsum's tree; bit-identical in the AVX2 library). On the 2-core AMD EPYC (AVX-512) it takes 0.4-0.9x
# torch's time at M = 1 (GEMV) and 0.4-0.8x at M = 8-2048 (GEMM) on the default and 1B models' shapes, the 1B
# down projection (K = 5632) excepted: 0.8-0.96x (benchmarks/bench_linear_rows.py --dtype float32; session 13
# in benchmarks/README.md). Not yet measured on the Intel machines (MKL). The price: fp32 results
# are no longer HF transformers' bits (torch sums K in another order). They agree to fp32 rounding (max error
# / max |y| ~2e-7 against an fp64 product at K = 576-1536, torch's ~4e-7); tests hold logprobs to HF's within
# 1e-4 (1e-5 in test_logprobs_exact) and greedy tokens identical.
SMALL_M_MAX = 2 if _AMX_OK else 1 << 30  # bf16 without AMX: every M (steps hold far fewer tokens)
AMX_MAX_M = 256 if _AMX_OK else 0
_OWN_MAX_M = max(SMALL_M_MAX, AMX_MAX_M)  # bf16 rows up to this go to one of pagellm's kernels


# CUDA: bf16 / fp16 linears of up to CUDA_GEMV_MAX_M rows take `linear_gemv`'s weight-streaming GEMV (kernel
# CUDA_GEMV_KERNEL, docs/cuda.md) instead of cuBLAS: 1 = one warp per column (session 17), 2 = split-K over a CTA's
# warps with several columns per warp (~512 CTAs), 3 = the same with more K slices (~1024 CTAs), 4 = kernel 2 with
# fewer registers at M <= 2 (kernel 2's bits). With CUDA_GEMV_PDL they launch as programmatic dependents (sm_90;
# ignored below): their first weight loads overlap the end of the norm / activation / attention kernel before them
# (those call griddepcontrol.launch_dependents), also inside CUDA graphs.
# Chosen from session 19's H200 runs (benchmarks/results/gpu-h200-session19, `profile_step.py`): the batch-1 graph
# replay of the ~1B model, medians of 3 interleaved rounds: cuBLAS 1.210 ms, kernel 1 1.273, 2 1.283, 3 1.546,
# 4 1.140, 2 + PDL 1.234, 4 + PDL **1.092**. Per shape at M = 1, kernel 4 + PDL reached 0.47-0.87 of the copy
# bandwidth (cuBLAS 0.33-0.91: ahead on o and down, behind on gate_up and the LM head); at M = 4 and 8 cuBLAS wins
# every shape, so only single rows take the GEMV. PAGELLM_CUDA_GEMV_MAX_M=0 is cuBLAS everywhere.
CUDA_GEMV_MAX_M = int(os.environ.get("PAGELLM_CUDA_GEMV_MAX_M", "1"))


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


CUDA_GEMV_KERNEL = int(_env_choice("PAGELLM_CUDA_GEMV_KERNEL", "4", ("1", "2", "3", "4")))
CUDA_GEMV_PDL = _env_choice("PAGELLM_CUDA_PDL", "1", ("0", "1")) == "1"


def _cpu_kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 or fp32 CPU tensors of one dtype and no autograd (the ops have none): pagellm's CPU kernels may run it."""
    dtype = x.dtype
    return (
        _SMALL_M_OK
        and (dtype is torch.bfloat16 or dtype is torch.float32)
        and weight.dtype is dtype
        and x.is_cpu
        and weight.is_cpu
        and (bias is None or bias.dtype is dtype)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except bf16 and fp32 CPU inputs, and bf16 / fp16 CUDA inputs of a few rows, go through pagellm's own
    kernels (see above).

    Everything else (other dtypes or devices, autograd, mixed dtypes) is exactly F.linear."""
    # Checked cheapest first: this runs ~4 times per layer per decode step.
    dtype = x.dtype
    if x.dim() >= 1 and _cpu_kernel_takes(x, weight, bias):
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        fp32 = dtype is torch.float32
        if 0 < m and (fp32 or m <= _OWN_MAX_M):
            op = _linear_small_m if fp32 or m <= SMALL_M_MAX else _linear_amx
            n = weight.shape[0]
            if x.dim() == 2:  # the decode case; every torch call costs microseconds here
                out = torch.empty((m, n), dtype=dtype)
                op(out, x, weight, bias)
                return out
            out = torch.empty(x.shape[:-1] + (n,), dtype=dtype)
            op(out.view(m, n), x.reshape(m, k), weight, bias)
            return out
    elif _CUDA_GEMV_OK and x.is_cuda and (dtype is torch.bfloat16 or dtype is torch.float16):
        return _cuda_gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def cuda_gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` runs linear_gemv for rows like x (CUDA bf16 / fp16, 1..CUDA_GEMV_MAX_M rows, weight and bias
    of x's dtype on CUDA, no autograd). x's last dim counts the rows only (a folded activation's [M, 2K] input)."""
    dtype = x.dtype
    if not (_CUDA_GEMV_OK and x.is_cuda and (dtype is torch.bfloat16 or dtype is torch.float16)):
        return False
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return (0 < m <= CUDA_GEMV_MAX_M and weight.dtype is dtype and weight.is_cuda
            and (bias is None or bias.dtype is dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _cuda_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """linear_gemv (kernel CUDA_GEMV_KERNEL) for a few rows, else F.linear (cuBLAS)."""
    if not cuda_gemv_takes(x, weight, bias):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    m = x.numel() // k
    out = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=x.dtype, device=x.device)
    _linear_gemv(out.view(m, -1), x.reshape(m, k), weight, bias, CUDA_GEMV_KERNEL, CUDA_GEMV_PDL)
    return out


def linear_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """int64 [M] = linear(x, weight).argmax(-1) (the first maximum of each row's logits as `linear` rounds them) for
    x [M, K] where `linear` would run linear_small_m (bf16 rows up to SMALL_M_MAX, fp32; CPU): the `linear_argmax` op,
    the same per-logit bits, the logits never stored at 1-16 rows (a decode row, a verify step's 1 + k rows). None
    where `linear` would take another kernel (AMX tiles, F.linear): the caller then computes the logits."""
    if (
        x.dim() == 2
        and 0 < x.shape[0]
        and (x.dtype is torch.float32 or x.shape[0] <= SMALL_M_MAX)
        and weight.shape[0] > 0
        and _cpu_kernel_takes(x, weight, None)
    ):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        _linear_argmax(out, x, weight, None)
        return out
    return None
