"""Mixture-of-experts MLP pieces: routing (`select_experts`) and the routed experts (`FusedMoE`).

A model's MoE block is: router logits = gate(x) -> `select_experts` (which experts, which weights) ->
`FusedMoE` (the chosen experts' SwiGLU / GeGLU MLPs, weighted and summed) -> plus any shared expert the
model has. Routing follows transformers' routers exactly (order of softmax / top-k / normalisation, fp32):

    Mixtral                 scoring="softmax", renormalize=True
    Qwen2-MoE / Qwen3-MoE   scoring="softmax", renormalize=config.norm_topk_prob
    DeepSeek-V2             scoring="softmax", renormalize=False, topk_method "greedy" (no groups) or
                            "group_limited_greedy" (num_expert_group=n_group, topk_group, group_scoring="max"),
                            routed_scaling_factor
    DeepSeek-V3             scoring="sigmoid", correction_bias=e_score_correction_bias, num_expert_group=n_group,
                            topk_group, group_scoring="top2_sum", renormalize=norm_topk_prob, routed_scaling_factor
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.communication import tensor_model_parallel_all_reduce
from pagellm.distributed.expert_sharding import plan_experts
from pagellm.ops.moe_reference import MOE_ACTIVATIONS
from pagellm.ops.moe_reference import fused_moe as fused_moe_reference
from pagellm.weight_utils import WeightShapeError, default_weight_loader

SCORING_FUNCS = ("softmax", "sigmoid")
GROUP_SCORINGS = ("max", "top2_sum")
# expert shard -> the FusedMoE parameter it loads into
EXPERT_SHARDS = {"gate": "w13_weight", "up": "w13_weight", "down": "w2_weight"}


# HF `hidden_act` -> fused_moe activation
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def moe_activation_for(hidden_act: str) -> str:
    """The `FusedMoE` activation for an HF `hidden_act`; ValueError naming it if the experts cannot run it."""
    if hidden_act not in _HF_ACTIVATIONS:
        raise ValueError(f"hidden_act={hidden_act!r} is not supported for MoE experts; supported: "
                         f"{sorted(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[hidden_act]


def check_routing(num_experts: int, top_k: int, *, scoring: str = "softmax", num_expert_group: int | None = None,
                  topk_group: int | None = None, group_scoring: str = "max",
                  num_experts_field: str = "num_experts", top_k_field: str = "num_experts_per_tok") -> None:
    """ValueError (naming the config fields) unless the routing is one `select_experts` can do.
    Models call it at construction, before any weight is read."""
    if num_experts < 1:
        raise ValueError(f"{num_experts_field}={num_experts}: a MoE layer needs at least one expert")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{top_k_field}={top_k} must be in [1, {num_experts_field}={num_experts}]")
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"unsupported MoE scoring function {scoring!r}; supported: {', '.join(SCORING_FUNCS)}")
    if group_scoring not in GROUP_SCORINGS:
        raise ValueError(f"unsupported expert group scoring {group_scoring!r}; supported: {', '.join(GROUP_SCORINGS)}")
    if num_expert_group is None and topk_group is None:
        return
    if num_expert_group is None or topk_group is None:
        raise ValueError(f"group-limited routing needs both n_group and topk_group (got n_group={num_expert_group}, "
                         f"topk_group={topk_group})")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"n_group={num_expert_group} must divide {num_experts_field}={num_experts}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={num_expert_group}]")
    per_group = num_experts // num_expert_group
    if group_scoring == "top2_sum" and per_group < 2:
        raise ValueError(f"group scoring 'top2_sum' needs >= 2 experts per group ({num_experts_field}={num_experts}, "
                         f"n_group={num_expert_group})")
    if top_k > topk_group * per_group:
        raise ValueError(f"{top_k_field}={top_k} exceeds the {topk_group * per_group} experts in topk_group="
                         f"{topk_group} groups of {per_group}")


def _group_mask(choice: torch.Tensor, num_groups: int, topk_group: int, group_scoring: str) -> torch.Tensor:
    """[T, E] bool: the experts in each token's `topk_group` best groups."""
    grouped = choice.view(choice.shape[0], num_groups, -1)
    if group_scoring == "max":
        group_scores = grouped.max(dim=-1).values
    else:  # "top2_sum" (DeepSeek-V3)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(choice.shape)


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool,
                   num_expert_group: int | None = None, topk_group: int | None = None, group_scoring: str = "max",
                   correction_bias: torch.Tensor | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their combine weights.

    router_logits:   [T, E] any float dtype (scores are computed in fp32)
    correction_bias: [E] or None; added to the scores only to choose experts (and groups), never to the weights
    num_expert_group / topk_group: group-limited routing (both or neither): experts are split into
                     `num_expert_group` equal groups, each scored by `group_scoring` ("max": its best expert,
                     "top2_sum": the sum of its two best), and only the `topk_group` best groups are eligible
    returns:         topk_weights float32 [T, top_k] (renormalized to sum 1 if asked, then times
                     `routed_scaling_factor`), topk_ids int32 [T, top_k] (distinct within a row)

    Arguments are assumed valid (see `check_routing`, which models call at construction).
    """
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None:
        eligible = _group_mask(choice, num_expert_group, topk_group, group_scoring)
        choice = choice.masked_fill(~eligible, float("-inf"))
    if correction_bias is None and num_expert_group is None:
        topk_weights, topk_ids = torch.topk(scores, top_k, dim=-1)
    else:
        # unsorted as DeepSeek-V3: the renormalizing sum then adds in the same order (bit-identical weights)
        topk_ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        # + 1e-20 as DeepSeek-V3 (sigmoid scores can all underflow); a no-op for softmax sums (>= top_k / E)
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids.to(torch.int32)


def fused_moe_caller(op):
    """(hidden, w13, w2, topk_weights, topk_ids, activation) -> out for a registered fused_moe overload, whether
    its schema returns the output or takes it first (`Tensor(a!) out`, then this allocates it)."""
    first = op._schema.arguments[0]
    if first.alias_info is None or not first.alias_info.is_write:
        return op

    def out_first(hidden, w13, w2, topk_weights, topk_ids, activation):
        out = torch.empty_like(hidden)
        op(out, hidden, w13, w2, topk_weights, topk_ids, activation)
        return out

    return out_first


def _compiled_fused_moe():
    """torch.ops.pagellm.fused_moe (its registered overload: the C++ glue checks the arguments) as a
    `fused_moe_caller`, or None when pagellm._C does not register it."""
    try:
        import pagellm.ops  # noqa: F401  (loads _C, which registers the ops)
    except Exception:  # pragma: no cover - a broken build falls back to the reference
        return None
    packet = getattr(torch.ops.pagellm, "fused_moe", None)
    return None if packet is None else fused_moe_caller(packet.default)


class FusedMoE(nn.Module):
    """The routed experts of a MoE MLP, stacked: expert e computes w2[e] @ (act(gate_e x) * up_e x).

    Parameters (model dtype, unquantized only):
        w13_weight [E, 2*I, H]  rows [0, I) = expert e's gate projection, rows [I, 2I) its up projection
        w2_weight  [E, H, I]    the down projection
    Each carries `weight_loader(param, tensor, expert_id=None, shard=None)`: one HF per-expert linear weight
    ([I, H] for shard "gate" / "up", [H, I] for "down") into expert `expert_id`, or with both None a whole
    stacked tensor as transformers 5.x holds it (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`).

    `quant_config`: a format that would quantize this layer (any method but the unquantized one for `prefix`,
    the layer's full name, e.g. "model.layers.0.mlp.experts") -> ValueError naming it; the model's dense
    layers may still be quantized.

    Tensor parallelism (pagellm.distributed.expert_sharding): each rank holds every expert's 1/tp slice of
    the intermediate dimension (`intermediate_size` is then the local width, `tp_shard` the slice; the
    loaders cut full checkpoint tensors) and, with `reduce_results`, all-reduces its partial output. A block
    that adds more partial terms (a shared expert) passes reduce_results=False and reduces once itself.
    `intermediate_size_field`: the config field named when it does not divide by the number of ranks.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 dtype: torch.dtype | None = None, quant_config=None, prefix: str = "", reduce_results: bool = True,
                 intermediate_size_field: str = "moe_intermediate_size") -> None:
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {activation!r}; supported: {', '.join(MOE_ACTIVATIONS)}")
        if min(num_experts, hidden_size, intermediate_size) < 1:
            raise ValueError(f"FusedMoE sizes must be >= 1 (num_experts={num_experts}, hidden_size={hidden_size}, "
                             f"intermediate_size={intermediate_size})")
        self._refuse_quantized(quant_config, prefix)
        self.tp_shard = plan_experts(intermediate_size, intermediate_size_field)
        if self.tp_shard is not None:
            intermediate_size = self.tp_shard.local
        self.reduce_results = reduce_results
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.prefix = prefix
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate_size, hidden_size)),
                            ("w2_weight", (num_experts, hidden_size, intermediate_size))):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)
        self._compiled = _compiled_fused_moe()

    def _refuse_quantized(self, quant_config, prefix: str) -> None:
        if quant_config is None:
            return
        from pagellm.quantization.unquantized import UnquantizedLinearMethod

        method = quant_config.get_linear_method(self, prefix or "experts")
        if not isinstance(method, UnquantizedLinearMethod):
            raise ValueError(f"{prefix or 'FusedMoE'}: quantized MoE experts are not supported (quantization "
                             f"{quant_config.get_name()!r} gives them {type(method).__name__}); load the model "
                             "unquantized")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int | None = None,
                      shard: str | None = None) -> None:
        if expert_id is None and shard is None:
            if self.tp_shard is not None:
                loaded_weight = self.tp_shard.slice_stacked(loaded_weight, param is self.w13_weight)
            default_weight_loader(param, loaded_weight)
            return
        self._check_expert_slot(param, expert_id, shard)
        if self.tp_shard is not None:
            loaded_weight = self.tp_shard.slice_per_expert(loaded_weight, shard)
        inter = self.intermediate_size
        target = param.data[expert_id]
        if shard == "gate":
            target = target[:inter]
        elif shard == "up":
            target = target[inter:]
        if tuple(target.shape) != tuple(loaded_weight.shape):
            raise WeightShapeError(f"shape mismatch for expert {expert_id} shard {shard!r}: expected "
                                   f"{tuple(target.shape)}, got {tuple(loaded_weight.shape)}")
        with torch.no_grad():
            target.copy_(loaded_weight)

    def _check_expert_slot(self, param: nn.Parameter, expert_id: int | None, shard: str | None) -> None:
        if shard not in EXPERT_SHARDS or param is not getattr(self, EXPERT_SHARDS[shard]):
            allowed = [s for s, p in EXPERT_SHARDS.items() if getattr(self, p) is param]
            raise ValueError(f"expert shard {shard!r} does not load into this parameter; allowed: {allowed}")
        if expert_id is None or not 0 <= expert_id < self.num_experts:
            raise WeightShapeError(f"expert id {expert_id} out of range [0, {self.num_experts})")

    def checkpoint_shape(self, param: nn.Parameter, expert_id: int | None, shard: str | None) -> tuple[int, ...]:
        """The shape of the HF tensor `weight_loader(param, tensor, expert_id, shard)` takes: a per-expert weight
        or, with both None, the stacked one; full intermediate width under tensor parallelism (the loader
        cuts it). ValueError for a shard of another parameter or an expert id out of range."""
        inter = self.tp_shard.full if self.tp_shard is not None else self.intermediate_size
        is_w13 = param is self.w13_weight
        if expert_id is None and shard is None:
            per_expert = (2 * inter, self.hidden_size) if is_w13 else (self.hidden_size, inter)
            return (self.num_experts, *per_expert)
        self._check_expert_slot(param, expert_id, shard)
        return (self.hidden_size, inter) if shard == "down" else (inter, self.hidden_size)

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_weights float32 [T, k], topk_ids int32 [T, k] (from `select_experts`) -> [T, H]
        (under tensor parallelism without reduce_results: this rank's partial sum)."""
        out = self._experts(hidden, topk_weights, topk_ids)
        if self.tp_shard is not None and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def _experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self._compiled is not None:
            return self._compiled(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)
        # The reference loops over the experts the tokens chose, so its op sequence depends on the routing.
        # Checking the ids reads routing data into Python, which makes a step-graph capture refuse this step
        # (it runs eagerly) instead of replaying one step's routing for every later one.
        if topk_ids.numel() and not bool(((topk_ids >= 0) & (topk_ids < self.num_experts)).all()):
            raise ValueError(f"topk_ids must lie in [0, {self.num_experts})")
        return fused_moe_reference(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.activation)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, "
                f"tp_shard={self.tp_shard}, compiled={self._compiled is not None}")
