"""LLM.int8() weights (Dettmers et al. 2022): `quantization="int8"` quantizes any float checkpoint at load.

    LLM(model, quantization="int8")          # fp16 / bf16 / fp32 checkpoint; activations keep the model dtype

Each linear weight [out, in] is stored as int8 `weight` [out, in] plus a float32 `weight_scale` [out]
(row absmax / 127). The product is `torch.ops.pagellm.int8_linear` (its pure-torch reference where the
compiled op is missing): activation columns with |x| > threshold (default 6.0) in any token of the batch
run in fp32 against the dequantized weight columns; the rest are quantized per token to 8 bits and multiplied
with the int8 weight into int32. The outlier column set is decided inside the op, so a decode step replays from a
step graph like any other (and a token's output depends on the other tokens of its batch through that set). The
LM head and embeddings stay in the model dtype, as do the linears named in `skip_modules` (bitsandbytes'
llm_int8_skip_modules).

Activation scheme (`activation_scheme`): "group" (the default) quantizes each token's non-outlier values by
their absmax per group of `group_size` (64) consecutive elements of K (vLLM's per-token-group activation
quantization; one fp32 scale per group, each group's int32 sum scaled into an fp32 accumulator); "absmax" is
bitsandbytes' symmetric int8 rule with one scale per token, s = absmax / 127; "zeropoint" quantizes each token
asymmetrically, uint8 codes over [min(x, 0), max(x, 0)] with an integer zero point (the paper's zero-point
vector-wise quantization; the zero point is folded into the int32 sums through the weight row sums, exact).
Measured on the default model (SmolLM2-135M), word perplexity of 4000 words of KJV Ecclesiastes
(bench_quant_ppl.py, bf16 activations, threshold 6.0) over bf16: group 64 +0.43 % (threshold 0: +1.04 %; group
128: +1.12 %), zero point +1.34 % (+0.93 % at threshold 4), absmax +2.43 %; int8 weights alone cost +0.53 %
(bench_int8_ablation.py, bf16), so the groups leave little activation loss. Their cost is compute, not bytes:
a group's int32 lanes are converted and multiplied into fp32 once per 64 elements (benchmarks/README.md,
session 13, has the decode-time ratios). 6.0 stays the default threshold (bitsandbytes, vLLM); a lower
threshold or skip_modules trade speed or memory for accuracy.

Loading: the checkpoint's float tensors arrive through `weight`'s shard loader, which quantizes each one
straight into its rows (the scale is per output row, so every shard of a merged layer quantizes on its
own). Peak memory is the int8 model plus a float32 copy of at most `_QUANTIZE_CHUNK_BYTES` of one tensor.
`weight_scale` is a buffer, derived, never a checkpoint tensor.

Checkpoints saved by bitsandbytes (quant_method "bitsandbytes", int8 `weight` + `SCB` row absmax +
`weight_format`) are not read: transformers documents `SCB` (its dequantization is weight * SCB / 127) but
not the encoding of `weight_format`, so such a file could be misread; load the float model instead.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

from pagellm.quantization.base import LinearMethodBase, QuantizationConfig, new_linear_param
from pagellm.quantization.registry import register_quantization_config
from pagellm.quantization.unquantized import UnquantizedLinearMethod
from pagellm.weight_utils import OutputShard, WeightShapeError

INT8_METHOD = "int8"
DEFAULT_THRESHOLD = 6.0
_QUANTIZE_CHUNK_BYTES = 64 << 20  # float32 staging per quantization step

ACTIVATION_SCHEMES = ("absmax", "zeropoint", "group")
DEFAULT_ACTIVATION_SCHEME = "group"  # see the module docstring

DEFAULT_GROUP_SIZE = 64  # "group": activation elements of K per scale

# (out [M, N], x [M, K], weight int8 [N, K], weight_scale fp32 [N], bias [N] | None, threshold, zero_point,
#  group_size) -> None
Int8Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", float, bool, int],
                  None]


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, in] float -> (int8 [rows, in], float32 scale [rows]) with scale = absmax / 127 and
    q = clamp(round_half_even(w * (127 / absmax)), -127, 127); an all-zero row gets scale 0 and q 0.
    The dequantized weight is q * scale[:, None]."""
    wf = w.float()
    if wf.shape[1] == 0:
        return torch.zeros(wf.shape, dtype=torch.int8, device=w.device), torch.zeros(wf.shape[0], device=w.device)
    absmax = wf.abs().amax(dim=1)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, 0.0)  # IEEE-rounded, as in the op
    q = torch.round(wf * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, absmax / 127.0


def dequantize_weight_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [rows, in] and float32 scale [rows] -> float32 [rows, in]."""
    return q.float() * scale[:, None]


def check_threshold(threshold: Any) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
        raise ValueError(f"int8 threshold must be a number >= 0 (0 = no outlier columns), got {threshold!r}")
    return float(threshold)


def check_activation_scheme(scheme: Any) -> str:
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"int8 activation_scheme must be one of {list(ACTIVATION_SCHEMES)}, got {scheme!r}")
    return scheme


def check_group_size(group_size: Any) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 64:
        raise ValueError(f"int8 group_size must be a positive multiple of 64 (64, 128, ...), got {group_size!r}")
    return group_size


def check_skip_modules(names: Any) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
            isinstance(n, str) and n and not n.startswith(".") and not n.endswith(".") for n in names):
        raise ValueError(f"int8 skip_modules must be a list of module names such as ['down_proj'] or "
                         f"['model.layers.0'], got {names!r}")
    return tuple(names)


def default_int8_op(device: torch.device) -> Int8Op:
    """The compiled op when pagellm._C has it for `device`, else the pure-torch reference (same semantics)."""
    from pagellm import ops  # noqa: PLC0415 (loads pagellm._C)
    from pagellm.ops import reference  # noqa: PLC0415

    compiled = ops.ops_available()[0] and hasattr(torch.ops.pagellm, "int8_linear")
    if compiled and device.type == "cuda":
        import pagellm._C as _C  # noqa: PLC0415

        compiled = bool(getattr(_C, "built_with_cuda", False))
    if compiled and device.type in ("cpu", "cuda"):
        return torch.ops.pagellm.int8_linear.default
    return reference.int8_linear


class Int8LinearMethod(LinearMethodBase):
    """weight int8 [out, in] (a parameter: the checkpoint's float `weight` loads into it, quantized),
    weight_scale float32 [out] (a buffer), optional bias [out] in the model dtype.

    `op` (default: `default_int8_op` for the weight's device, chosen after loading) may be replaced, e.g.
    by `pagellm.ops.reference.int8_linear` to compare against the reference on the same weights."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, op: Int8Op | None = None,
                 activation_scheme: str = DEFAULT_ACTIVATION_SCHEME, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.threshold = check_threshold(threshold)
        self.activation_scheme = check_activation_scheme(activation_scheme)
        self.zero_point = activation_scheme == "zeropoint"
        self.group_size = check_group_size(group_size) if activation_scheme == "group" else 0
        self.op = op

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], output_size: int,
                       params_dtype: torch.dtype, bias: bool, **extra: Any) -> None:
        layer.register_parameter("weight", new_linear_param(
            (output_size, input_size), torch.int8, dict(extra, quantizes_on_load=True),  # takes float tensors
            shard_loader=_quantizing_shard_loader(layer)))
        layer.register_buffer("weight_scale", torch.zeros(output_size, dtype=torch.float32))
        if bias:
            layer.register_parameter("bias", new_linear_param((output_size,), params_dtype, extra))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.op is None:
            self.op = default_int8_op(layer.weight.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        op = self.op if self.op is not None else default_int8_op(x.device)
        n = layer.weight.shape[0]
        if x.dim() == 2:  # the decode case: as few torch calls as possible
            out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
            op(out, x, layer.weight, layer.weight_scale, bias, self.threshold, self.zero_point, self.group_size)
            return out
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        op(out, x2, layer.weight, layer.weight_scale, bias, self.threshold, self.zero_point, self.group_size)
        return out.view(x.shape[:-1] + (n,))


def _quantizing_shard_loader(layer: nn.Module):
    """A shard loader that quantizes a float checkpoint tensor into the int8 weight rows it owns and writes
    their scales into `layer.weight_scale` (held weakly: the layer owns the parameter holding this loader)."""
    layer_ref = weakref.ref(layer)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: OutputShard | None) -> None:
        offset, size = (0, param.shape[0]) if shard is None else (shard.offset, shard.size)
        target = param.data.narrow(0, offset, size)
        name = "weight" if shard is None else f"shard {shard.shard_id!r}"
        if tuple(target.shape) != tuple(loaded.shape):
            raise WeightShapeError(f"shape mismatch for {name}: expected {tuple(target.shape)}, got "
                                   f"{tuple(loaded.shape)}")
        if not loaded.is_floating_point():
            raise WeightShapeError(f"quantization='int8' quantizes float checkpoints; {name} is {loaded.dtype}")
        scale = layer_ref().weight_scale.narrow(0, offset, size)
        rows_per_chunk = max(1, _QUANTIZE_CHUNK_BYTES // (4 * max(1, loaded.shape[1])))
        with torch.no_grad():
            for start in range(0, size, rows_per_chunk):
                rows = min(rows_per_chunk, size - start)
                q, s = quantize_weight_rows(loaded.narrow(0, start, rows).to(target.device))
                target.narrow(0, start, rows).copy_(q)
                scale.narrow(0, start, rows).copy_(s)

    return load


@register_quantization_config(INT8_METHOD)
class Int8Config(QuantizationConfig):
    """Every linear layer of the decoder in LLM.int8() (`Int8LinearMethod`) with one outlier `threshold`,
    except those `skip_modules` names (kept in the model dtype). A name matches a layer whose dotted prefix is
    it or contains it as whole components: "down_proj" matches every "model.layers.<i>.mlp.down_proj",
    "model.layers.0" all of layer 0's linears. Names are pagellm's modules, where q/k/v are one "qkv_proj"
    and gate/up one "gate_up_proj" (a merged layer is quantized or skipped whole).
    `activation_scheme`: how each token's non-outlier activations become 8-bit in `int8_linear`, "absmax"
    (symmetric int8, bitsandbytes' rule), "zeropoint" (asymmetric uint8 over the token's range with an
    integer zero point, the paper's zero-point vector-wise quantization) or "group" (absmax per group of
    `group_size` elements of K, a multiple of 64; vLLM's per-token-group rule). See the module docstring for the
    measurements behind the default.
    From a checkpoint's quantization_config: {"quant_method": "int8", "threshold": 6.0, "skip_modules": [],
    "activation_scheme": "group", "group_size": 64} (all optional)."""

    _KEYS = ("quant_method", "threshold", "skip_modules", "activation_scheme", "group_size")

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, skip_modules: list[str] | tuple[str, ...] = (),
                 activation_scheme: str = DEFAULT_ACTIVATION_SCHEME, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        self.threshold = check_threshold(threshold)
        self.skip_modules = check_skip_modules(skip_modules)
        self.activation_scheme = check_activation_scheme(activation_scheme)
        self.group_size = check_group_size(group_size)

    @classmethod
    def get_name(cls) -> str:
        return INT8_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Int8Config":
        unknown = sorted(set(config) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"int8 quantization_config: unknown keys {unknown}; allowed: {list(cls._KEYS)}")
        return cls(config.get("threshold", DEFAULT_THRESHOLD), config.get("skip_modules", ()),
                   config.get("activation_scheme", DEFAULT_ACTIVATION_SCHEME),
                   config.get("group_size", DEFAULT_GROUP_SIZE))

    def is_skipped(self, prefix: str) -> bool:
        return any(f".{name}." in f".{prefix}." for name in self.skip_modules)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        if self.is_skipped(prefix):
            return UnquantizedLinearMethod()
        return Int8LinearMethod(self.threshold, activation_scheme=self.activation_scheme, group_size=self.group_size)


__all__ = [
    "ACTIVATION_SCHEMES", "DEFAULT_ACTIVATION_SCHEME", "DEFAULT_THRESHOLD", "INT8_METHOD", "Int8Config",
    "Int8LinearMethod", "default_int8_op",
    "dequantize_weight_rows", "quantize_weight_rows",
]
