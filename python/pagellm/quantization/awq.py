"""AutoAWQ checkpoints (4-bit weights, one fp16 scale and 4-bit zero point per group of `group_size` inputs).

    LLM("path/to/model-awq")                       # quantization_config.quant_method == "awq" in config.json
    LLM("path/to/model-awq", quantization="awq")   # the same, stated
    pagellm quantize --method awq --model MODEL --output OUT   # makes such a directory from a float checkpoint

The checkpoint's format is read from config.json's `quantization_config` or, for older AutoAWQ exports, a
`quant_config.json` next to it (both spellings: `bits`/`w_bit`, `group_size`/`q_group_size`). Supported:
bits 4, zero_point true, version "gemm" (AutoAWQ's default layout; "gemv" packs differently and is refused),
group_size a multiple of 32 (the kernel's block) or -1, which AutoAWQ's GEMM layer reads as one group of the
whole input dim (so the group size is per layer: its in_features).

Every decoder linear (q/k/v/o, gate/up/down) is AWQ unless its HF module name contains an entry of
`modules_to_not_convert` (AutoAWQ's substring rule; a merged layer is matched by its HF shard names, e.g.
qkv_proj by q_proj/k_proj/v_proj, and all of them must agree). The LM head and embeddings stay float.

Loading: AutoAWQ's tensors load as they sit in the file (`AWQLinearMethod`), are checked against the config
before the model is built (`check_checkpoint`), and are repacked once into `awq_linear`'s layout afterwards
(`awq_format.awq_to_kernel_layout`), freeing the checkpoint-layout copies.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagellm.quantization.awq_format import AWQ_PACK_FACTOR, KERNEL_BLOCK, awq_to_kernel_layout
from pagellm.quantization.base import LinearMethodBase, QuantizationConfig, new_linear_param
from pagellm.quantization.registry import register_quantization_config
from pagellm.quantization.unquantized import UnquantizedLinearMethod
from pagellm.weight_utils import OutputShard, WeightShapeError, load_output_slice

AWQ_METHOD = "awq"
AWQ_QUANT_CONFIG_FILE = "quant_config.json"  # AutoAWQ's own file next to config.json
SUPPORTED_BITS = (4,)
SUPPORTED_VERSIONS = ("gemm",)
WHOLE_INPUT_GROUP = -1
QUANTIZE_FIRST = "run `pagellm quantize --method awq --model MODEL --output OUT` first and load OUT"
# merged layer -> the HF modules it holds (for modules_to_not_convert, which names HF modules)
MERGED_HF_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_FLOAT_DTYPES = ("F16", "BF16", "F32")  # safetensors dtype names accepted for `scales`

# (out [M, N], x [M, K], qweight uint8 [N, K/2], scales fp32 [N, K/G], zeros uint8 [N, K/G], group, bias) -> None
AWQOp = Callable[..., None]


def default_awq_op(device: torch.device) -> AWQOp:
    """`torch.ops.pagellm.awq_linear` when pagellm._C has a kernel for `device`, else its pure-torch reference."""
    from pagellm import ops  # noqa: PLC0415 (loads pagellm._C)
    from pagellm.ops import reference  # noqa: PLC0415

    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    if (ops.ops_available()[0] and hasattr(torch.ops.pagellm, "awq_linear") and key is not None
            and torch._C._dispatch_has_kernel_for_dispatch_key("pagellm::awq_linear", key)):
        return torch.ops.pagellm.awq_linear.default
    return reference.awq_linear


def _checked_loader(tensor: str, packed: bool) -> Callable[[nn.Parameter, torch.Tensor, Any], None]:
    """`load_output_slice` after refusing a checkpoint tensor of the wrong kind (copy_ would convert silently):
    packed nibbles must be int32, scales floating point."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard: OutputShard | None) -> None:
        if (loaded.dtype == torch.int32) if packed else loaded.is_floating_point():
            load_output_slice(param, loaded, shard)
            return
        raise WeightShapeError(f"AWQ {tensor} must be {'int32' if packed else 'floating point'}, got {loaded.dtype}")

    return load


class AWQLinearMethod(LinearMethodBase):
    """One AWQ linear layer with logical weight W [N = out, K = in] and group size G.

    While loading (AutoAWQ's layout, split along dim 1 for merged layers' shards):
        qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8] (8 nibbles per int32), scales float32 [K / G, N]
        (float32 so fp16 and bf16 checkpoints both load exactly); bias [N] in the model dtype.
    After `process_weights_after_loading` (awq_linear's layout; qzeros is gone):
        qweight uint8 [N, K / 2], scales float32 [N, K / G], zeros uint8 [N, K / G].
    `op` (default `default_awq_op` for the weight's device) may be swapped, e.g. for the reference."""

    def __init__(self, group_size: int, op: AWQOp | None = None) -> None:
        if group_size != WHOLE_INPUT_GROUP and (group_size <= 0 or group_size % KERNEL_BLOCK):
            raise ValueError(f"AWQ group_size must be a positive multiple of {KERNEL_BLOCK} or -1, got {group_size}")
        self.config_group_size = group_size
        self.group_size = group_size  # resolved per layer in create_weights (-1 -> in_features)
        self.op = op

    def create_weights(self, layer: nn.Module, input_size: int, output_partition_sizes: list[int], output_size: int,
                       params_dtype: torch.dtype, bias: bool, **extra: Any) -> None:
        name = getattr(layer, "prefix", "") or "linear layer"
        plan = getattr(layer, "tp_plan", None)  # tensor parallelism: input_size / output sizes are this rank's
        split = "" if plan is None else " per tensor-parallel rank"
        group = input_size if self.config_group_size == WHOLE_INPUT_GROUP else self.config_group_size
        if input_size % group or input_size % KERNEL_BLOCK:
            raise ValueError(f"{name}: in_features{split}={input_size} is not a multiple of the AWQ group_size "
                             f"{group} (and of {KERNEL_BLOCK})" + (": a row-parallel layer's ranks must each hold "
                                                                   "whole groups" if split else ""))
        if any(size % AWQ_PACK_FACTOR for size in output_partition_sizes):
            raise ValueError(f"{name}: AWQ packs {AWQ_PACK_FACTOR} output features per int32, but its output "
                             f"shards have sizes{split} {output_partition_sizes}")
        self.group_size = group
        packed, groups = output_size // AWQ_PACK_FACTOR, input_size // group
        # a row-parallel rank's input rows are whole groups: qweight is cut by rows, qzeros / scales by groups
        # (one group over the whole input, group_size -1: every rank keeps that group's row)
        grouped = {"input_dim": None} if self.config_group_size == WHOLE_INPUT_GROUP else {
            "input_dim": 0, "input_units": (group, 1)}
        int_loader = {"output_dim": 1, "output_pack_factor": AWQ_PACK_FACTOR}
        layer.register_parameter("qweight", new_linear_param(
            (input_size, packed), torch.int32, extra, **int_loader, input_dim=0,
            shard_loader=_checked_loader("qweight", True)))
        layer.register_parameter("qzeros", new_linear_param(
            (groups, packed), torch.int32, extra, **int_loader, **grouped, shard_loader=_checked_loader("qzeros", True)))
        layer.register_parameter("scales", new_linear_param(
            (groups, output_size), torch.float32, extra, output_dim=1, **grouped,
            shard_loader=_checked_loader("scales", False)))
        if bias:
            layer.register_parameter("bias", new_linear_param((output_size,), params_dtype, extra))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, zeros = awq_to_kernel_layout(layer.qweight.data, layer.qzeros.data, layer.scales.data,
                                                      self.group_size)
        del layer.qweight, layer.qzeros, layer.scales  # the checkpoint layout is freed here
        for pname, tensor in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
            layer.register_parameter(pname, nn.Parameter(tensor, requires_grad=False))
        if self.op is None:
            self.op = default_awq_op(qweight.device)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        op = self.op if self.op is not None else default_awq_op(x.device)
        k, n = layer.in_features, layer.out_features
        if x.dim() == 2:  # the decode case: as few torch calls as possible
            out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
            op(out, x, layer.qweight, layer.scales, layer.zeros, self.group_size, bias)
            return out
        m = x.numel() // k
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
        op(out.view(m, n), x.reshape(m, k), layer.qweight, layer.scales, layer.zeros, self.group_size, bias)
        return out


def _key(config: dict[str, Any], names: tuple[str, str], default: Any) -> Any:
    """A value AutoAWQ spells two ways (config.json style first, quant_config.json style second)."""
    present = [config[n] for n in names if n in config]
    if len(present) == 2 and present[0] != present[1]:
        raise ValueError(f"AWQ quantization_config: {names[0]}={present[0]!r} and {names[1]}={present[1]!r} disagree")
    return present[0] if present else default


@register_quantization_config(AWQ_METHOD)
class AWQConfig(QuantizationConfig):
    """4-bit AutoAWQ ("gemm") weights with `group_size` inputs per scale/zero (-1: the layer's whole input);
    modules whose HF name contains an entry of `modules_to_not_convert` stay float."""

    def __init__(self, group_size: int = 128, modules_to_not_convert: list[str] | None = None, bits: int = 4,
                 zero_point: bool = True, version: str = "gemm") -> None:
        if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
            raise ValueError(f"AWQ bits={bits!r} is not supported; supported: {list(SUPPORTED_BITS)}")
        if zero_point is not True:
            raise ValueError(f"AWQ zero_point={zero_point!r} (symmetric) is not supported; supported: zero_point=True")
        if not isinstance(version, str) or version.lower() not in SUPPORTED_VERSIONS:
            raise ValueError(f"AWQ version {version!r} is not supported (\"gemv\" packs weights differently); "
                             f"supported: {list(SUPPORTED_VERSIONS)}: export the model with version=\"gemm\"")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not (
                group_size == WHOLE_INPUT_GROUP or (group_size > 0 and group_size % KERNEL_BLOCK == 0)):
            raise ValueError(f"AWQ group_size={group_size!r} is not supported; supported: a positive multiple of "
                             f"{KERNEL_BLOCK} (e.g. 32, 64, 128) or -1 (one group per input row)")
        skip = [] if modules_to_not_convert is None else modules_to_not_convert
        if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) and m for m in skip):
            raise ValueError(f"AWQ modules_to_not_convert must be a list of module names or null, got {skip!r}")
        self.group_size, self.modules_to_not_convert = group_size, list(skip)

    @classmethod
    def get_name(cls) -> str:
        return AWQ_METHOD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AWQConfig":
        """config.json's `quantization_config` or AutoAWQ's quant_config.json ({} when the checkpoint has
        neither: it is not AWQ-quantized, and is refused)."""
        if not config:
            raise ValueError(f"quantization={AWQ_METHOD!r} loads a checkpoint already quantized with AWQ, but this "
                             f"one has no quantization_config (config.json) or {AWQ_QUANT_CONFIG_FILE}: it is not "
                             f"AWQ-quantized; {QUANTIZE_FIRST}")
        return cls(group_size=_key(config, ("group_size", "q_group_size"), 128),
                   modules_to_not_convert=config.get("modules_to_not_convert"),
                   bits=_key(config, ("bits", "w_bit"), 4), zero_point=config.get("zero_point", True),
                   version=config.get("version", "gemm"))

    def is_skipped(self, hf_module: str) -> bool:
        """Whether the HF module (e.g. "model.layers.0.self_attn.q_proj") stays float (AutoAWQ's substring rule)."""
        return any(name in hf_module for name in self.modules_to_not_convert)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase:
        parent, _, leaf = prefix.rpartition(".")
        hf_modules = [f"{parent}.{m}" if parent else m for m in MERGED_HF_MODULES.get(leaf, (leaf,))]
        skipped = [m for m in hf_modules if self.is_skipped(m)]
        if skipped and len(skipped) != len(hf_modules):
            raise ValueError(f"{prefix}: modules_to_not_convert keeps {skipped} float but not the rest of "
                             f"{hf_modules}, which pagellm merges into one layer; a merged layer needs one format")
        return UnquantizedLinearMethod() if skipped else AWQLinearMethod(self.group_size)

    def check_checkpoint(self, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Every `*.qweight` must come with `qzeros` and `scales` whose dtypes and shapes agree with it and
        with group_size (ValueError naming the tensor), from the file headers, before the model is built."""
        modules = sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight"))
        if not modules:
            raise ValueError(f"the checkpoint's config says quant_method={AWQ_METHOD!r} but it holds no AWQ tensors "
                             f"(*.qweight); {QUANTIZE_FIRST}")
        for module in modules:
            if self.is_skipped(module):
                raise ValueError(f"tensor {module + '.qweight'!r}: {module} is listed in modules_to_not_convert "
                                 f"{self.modules_to_not_convert} but is stored quantized")
            _check_awq_module(module, tensors, self.group_size)


def _check_awq_module(module: str, tensors: dict[str, tuple[str, tuple[int, ...]]], group_size: int) -> None:
    """One module's qweight [K, N/8], qzeros [K/G, N/8] int32 and scales [K/G, N] float against each other."""
    dtype, shape = tensors[module + ".qweight"]
    if dtype != "I32" or len(shape) != 2:
        raise ValueError(f"tensor {module + '.qweight'!r}: expected a 2-D int32 tensor [in, out / 8], got {dtype} "
                         f"{list(shape)}")
    k, n = shape[0], shape[1] * AWQ_PACK_FACTOR
    group = k if group_size == WHOLE_INPUT_GROUP else group_size
    if k % group:
        raise ValueError(f"tensor {module + '.qweight'!r}: in_features={k} is not a multiple of the config's "
                         f"group_size={group_size}")
    expected = {"qzeros": (("I32",), (k // group, shape[1])), "scales": (_FLOAT_DTYPES, (k // group, n))}
    for leaf, (dtypes, want) in expected.items():
        name = f"{module}.{leaf}"
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is missing (every AWQ qweight needs qzeros and scales)")
        got_dtype, got = tensors[name]
        if got_dtype not in dtypes or tuple(got) != want:
            raise ValueError(f"tensor {name!r}: expected {'/'.join(dtypes)} {list(want)} for qweight {list(shape)} "
                             f"with group_size={group_size}, got {got_dtype} {list(got)} (does the checkpoint's "
                             "group size match its quantization_config?)")


__all__ = [
    "AWQ_METHOD", "AWQ_QUANT_CONFIG_FILE", "AWQConfig", "AWQLinearMethod", "SUPPORTED_BITS", "SUPPORTED_VERSIONS",
    "default_awq_op",
]
