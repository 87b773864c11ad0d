"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (layers/mla.py) + dense or mixture-of-experts MLPs.

Layer i's MLP is a MoE block when i >= first_k_dense_replace and i % moe_layer_freq == 0, else a dense
SwiGLU MLP. A MoE block is the router (`mlp.gate.weight`, V3 also `mlp.gate.e_score_correction_bias`) ->
`select_experts` -> `FusedMoE` (HF per-expert tensors `mlp.experts.{e}.{gate,up,down}_proj.weight`), plus
`n_shared_experts` always-on experts as one MLP (`mlp.shared_experts`). Routing as transformers:

    V2: softmax scores; topk_method "greedy" or "group_limited_greedy" (groups scored by their best expert)
    V3: sigmoid scores + e_score_correction_bias to choose, groups scored by their two best ("noaux_tc")
    both: norm_topk_prob renormalizes, then times routed_scaling_factor

Every layer caches one latent row per token (MLAAttentionSpec). Float caches and unquantized weights only.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed import get_tp_size
from pagellm.distributed.communication import tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_linear import row_parallel_partial
from pagellm.distributed.pipeline import StageAbsent
from pagellm.kv_cache.spec import KVCacheSpec, MLAAttentionSpec
from pagellm.layers.activation import get_act_and_mul
from pagellm.layers.linear import Linear, MergedLinear
from pagellm.layers.mla import MultiHeadLatentAttention
from pagellm.layers.moe import FusedMoE, check_routing, select_experts
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import compute_inv_freq, rope_parameters_from_config
from pagellm.models.llama import LlamaForCausalLM
from pagellm.models.registry import register_model

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def is_moe_layer(config, layer_idx: int) -> bool:
    if not getattr(config, "n_routed_experts", None):
        return False
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    return layer_idx >= first_dense and layer_idx % (getattr(config, "moe_layer_freq", 1) or 1) == 0


def _check_dim(config, field: str, required: bool = True, even: bool = False) -> None:
    value = getattr(config, field, None)
    if value is None and not required:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (even and value % 2):
        kind = "an even integer >= 2" if even else "an integer >= 1"
        raise ValueError(f"DeepSeek MLA config: {field} must be {kind}, got {value!r}")


def check_deepseek_config(config, sigmoid_routing: bool) -> None:
    """ValueError naming the config field for anything this implementation cannot run, before any weight exists."""
    for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_attention_heads", "hidden_size"):
        _check_dim(config, field)
    _check_dim(config, "qk_rope_head_dim", even=True)
    _check_dim(config, "q_lora_rank", required=False)
    params = rope_parameters_from_config(config)
    try:
        compute_inv_freq(params, config.qk_rope_head_dim, int(getattr(config, "max_position_embeddings", 0) or 8192))
    except KeyError as e:
        raise ValueError(f"DeepSeek config: rope_scaling / rope_parameters of type {params.get('rope_type')!r} "
                         f"lacks {e.args[0]!r}") from None
    get_act_and_mul(getattr(config, "hidden_act", "silu"))
    if not any(is_moe_layer(config, i) for i in range(config.num_hidden_layers)):
        return
    _check_dim(config, "moe_intermediate_size")
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k is None:
        raise ValueError("DeepSeek config: num_experts_per_tok is required for MoE layers")
    opts = routing_options(config, sigmoid_routing)
    check_routing(config.n_routed_experts, top_k, num_experts_field="n_routed_experts",
                  **{k: opts[k] for k in ("scoring", "num_expert_group", "topk_group", "group_scoring") if k in opts})


def routing_options(config, sigmoid_routing: bool) -> dict:
    """`select_experts` keyword arguments for a DeepSeek MoE layer (see the module docstring)."""
    opts = dict(scoring="sigmoid" if sigmoid_routing else "softmax",
                renormalize=bool(getattr(config, "norm_topk_prob", False)),
                routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0))
    if sigmoid_routing:  # transformers' V3 router always groups ("noaux_tc"); one group = no restriction
        n_group = config.n_group or 1
        opts.update(num_expert_group=n_group, topk_group=config.topk_group or 1,
                    group_scoring="top2_sum" if n_group > 1 else "max")
        return opts
    method = getattr(config, "topk_method", "greedy") or "greedy"
    if method not in V2_TOPK_METHODS:
        raise ValueError(f"DeepSeek-V2 config: unsupported topk_method {method!r}; supported: {V2_TOPK_METHODS}")
    if method == "group_limited_greedy":
        opts.update(num_expert_group=config.n_group, topk_group=config.topk_group, group_scoring="max")
    return opts


class DeepseekMLP(nn.Module):
    """SwiGLU MLP (dense layers and the shared experts): gate_proj + up_proj merged as gate_up_proj; under
    tensor parallelism column- then row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias, dtype=dtype,
                                         tp_mode="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, tp_mode="row")
        self.act_fn = get_act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output under tensor parallelism (not yet summed over the ranks)."""
        return row_parallel_partial(self.down_proj, self.act_fn(self.gate_up_proj(x)))


class DeepseekRouter(nn.Module):
    """`mlp.gate`: logits = x @ weight^T in float32 (as transformers), [T, E]."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False) if correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Routed experts (FusedMoE) + shared experts; forward(x [T, H]) -> [T, H]."""

    def __init__(self, config, dtype: torch.dtype, sigmoid_routing: bool) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.gate = DeepseekRouter(num_experts, config.hidden_size, dtype, correction_bias=sigmoid_routing)
        shared = getattr(config, "n_shared_experts", None) or 0
        # with shared experts, the routed and shared partial sums are all-reduced once, together
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size, dtype=dtype,
                                reduce_results=not shared)
        self.shared_experts = (DeepseekMLP(config.hidden_size, config.moe_intermediate_size * shared, config.hidden_act,
                                           dtype, bool(getattr(config, "mlp_bias", False))) if shared else None)
        self.routing = routing_options(config, sigmoid_routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, correction_bias=self.gate.e_score_correction_bias,
                                      **self.routing)
        out = self.experts(x, weights, ids)
        if self.shared_experts is None:
            return out
        out = out + self.shared_experts.forward_partial(x)
        return tensor_model_parallel_all_reduce(out) if get_tp_size() > 1 else out


class DeepseekDecoderLayer(nn.Module):
    sigmoid_routing = False  # V3: sigmoid scores with a correction bias

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, window_size: int = -1, quant_config=None,
                 prefix: str = "") -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(config, layer_idx, dtype)
        if is_moe_layer(config, layer_idx):
            self.mlp = DeepseekMoE(config, dtype, self.sigmoid_routing)
        else:
            self.mlp = DeepseekMLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype,
                                   bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, positions, hidden, residual, ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3DecoderLayer(DeepseekDecoderLayer):
    sigmoid_routing = True


@register_model("DeepseekV2ForCausalLM")
class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite). Quantized weights and quantized KV caches are refused (ValueError)."""

    layer_cls = DeepseekDecoderLayer
    stacked_params_mapping = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    expert_params_mapping = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, config, dtype: torch.dtype = torch.float32, quant_config=None) -> None:
        if quant_config is not None:
            raise ValueError(f"{type(self).__name__}: quantized weights ({quant_config.get_name()!r}) are not "
                             "supported for MLA models; load the checkpoint unquantized")
        check_deepseek_config(config, self.layer_cls.sigmoid_routing)
        super().__init__(config, dtype)

    @staticmethod
    def window_size_for_layer(config, layer_idx: int) -> int:
        return -1

    # ---- KV cache: one latent row per token and layer --------------------------------------------
    def mla_layers(self) -> list[MultiHeadLatentAttention]:
        """This pipeline stage's (every layer on a single stage)."""
        return [layer.self_attn for layer in self.model.layers if not isinstance(layer, StageAbsent)]

    @property
    def num_layers(self) -> int:
        return len(self.mla_layers())

    @property
    def num_kv_heads(self) -> int:
        return 1  # the latent is shared by every head

    @property
    def head_dim(self) -> int:
        return self.mla_layers()[0].spec.latent_dim

    @property
    def window_sizes(self) -> list[int]:
        return [-1] * self.num_layers

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype | str) -> dict[int, KVCacheSpec]:
        """Layer id -> MLAAttentionSpec (latent_dim = kv_lora_rank + qk_rope_head_dim); float cache dtypes only."""
        if isinstance(dtype, str):
            raise ValueError(f"kv_cache_dtype {dtype!r}: quantized latent caches are not supported for "
                             f"{type(self).__name__}; use 'auto' or a float dtype")
        return {m.spec.layer_idx: MLAAttentionSpec(block_size, m.spec.latent_dim, dtype) for m in self.mla_layers()}

    # ---- weights: HF per-expert tensors load into FusedMoE through base's expert_params_mapping -------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """base.load_weights, skipping V3's multi-token-prediction layers (num_nextn_predict_layers: tensors
        of layer indices past num_hidden_layers), which are unused, as in HF."""
        num_layers = self.config.num_hidden_layers

        def decoder_weights():
            for name, tensor in weights:
                layer = _LAYER_INDEX.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    yield name, tensor

        return super().load_weights(decoder_weights())


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1: V2's MLA with sigmoid + bias (noaux_tc) routing and `rope_interleave`."""

    layer_cls = DeepseekV3DecoderLayer

