"""AWQ calibration of a Llama-family HF model, decoder layer by decoder layer (`pagellm quantize --method awq`).

The float model is HF transformers' in float32. For each decoder layer:
 1. run it on the current hidden states [samples, seq, hidden], summarizing the linears' inputs with hooks
    (`InputStats`: the Gram matrix x^T x and sum |x|, all the searches need; q/k/v and gate/up share theirs);
 2. per scaling group (prev op -> linears reading its output), search s = mean|x|^alpha / mean_w^(1 - alpha)
    (`search_scale`; AutoAWQ's default duo scaling, `duo_scaling=False`: the paper's mean|x|^alpha):
        input_layernorm          -> q/k/v_proj
        v_proj                   -> o_proj     (only when their weights have the same shape, i.e. no GQA: AutoAWQ)
        post_attention_layernorm -> gate/up_proj
        up_proj                  -> down_proj
    and fold it: the consumers' input columns * s, the previous op / s (norm weight, or the linear's rows
    and bias), so the float layer computes the same function. That grid is judged by round-to-nearest's
    error, not by the rounding the calibration then does: `scale_search="rounding"` judges s = 1 and a few
    low alphas by the configured rounding itself (`ROUNDING_SEARCH_ALPHAS`), `"none"` keeps s = 1. On the
    default model (Q4_1-grid weights, GPTQ + group search + refine) RTN's choice raised every scaling
    group's held-out output error 4-22 % over s = 1: scaling by s takes the weights off their grid;
 3. clip search per linear except q/k (AutoAWQ skips them: attention scores forgive their rounding);
 4. round every linear into AWQ's groups, `rounding="rtn"`: `quantize_awq` (round to nearest, AWQ's), or
    `"gptq"`: `awq_gptq.gptq_quantize` (error feedback across input columns from the linear's own Gram
    matrix, each group's clip bounds searched on its updated weights; same format), put the dequantized
    weights back in the layer and run it again: the next layer calibrates on the inputs it will really see
    (AutoAWQ instead feeds the float layer's output).
`true_sequential` rounds the layer in four stages in the forward's order (q/k/v; o; gate/up; down), each
stage's inputs captured afresh from the layer whose earlier linears are already rounded (GPTQ's "true
sequential"): o_proj is rounded for the inputs the rounded q/k/v give it, and so on; the MLP's scaling groups
are searched on the inputs of the rounded attention. `group_search` picks each group's (scale, integer
zero) by its output error (`awq_group_search`; the default model's Q4_1-grid weights lose nearly all of
RTN's error to the integer zero point). Both off by default (session 15's behaviour). (Rounding each linear
towards the weight that best reproduces the float model's output, GPTAQ-style, was tried in session 16 and
removed: +2165 % perplexity on the default model; benchmarks/README.md.)
Search losses are the linears' own output errors (AutoAWQ looks at the whole attention / MLP output for
the q/k/v and gate/up groups; the linears' outputs are cheaper and what the paper's objective states).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from pagellm.quantization.awq_format import AWQ_PACK_FACTOR, dequantize_awq, pack_awq, quantize_awq, unpack_awq_int4
from pagellm.quantization.awq_gptq import DAMP_FRACTION, gptq_quantize
from pagellm.quantization.awq_group_search import search_quantize
from pagellm.quantization.awq_refine import REFINE_DAMP, refine_rounding
from pagellm.quantization.awq_search import (
    InputStats, apply_clip, output_error, search_clip, search_scale, search_scale_by_rounding,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTN_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP_LINEARS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LAYER_LINEARS = ATTN_LINEARS + MLP_LINEARS
NO_CLIP_LINEARS = ("self_attn.q_proj", "self_attn.k_proj")
GROUP_SIZE_CHOICES = (128, 64, 32)  # the automatic choice: the largest that divides every linear's inputs
ROUNDINGS = ("rtn", "gptq")
# how each scaling group's s is chosen: "rtn": AutoAWQ's alpha grid judged by round-to-nearest's error (`search_scale`);
# "rounding": s = 1 or a few alphas judged by the configured rounding itself (`search_scale_by_rounding`);
# "none": s = 1, no AWQ scaling (see the module doc for why these exist)
SCALE_SEARCHES = ("rtn", "rounding", "none")
# alpha candidates of scale_search="rounding" beside s = 1: on the default model's Q4_1-grid weights, the held-out
# error of GPTQ + group search + refine grew with alpha (s = 1 best in 9 of 9 groups of layers 0, 3, 14, 25,
# alpha 0.25 within -2..+18 %, 0.5 +18..+59 %: benchmarks/README.md session 18), so the grid stays low
ROUNDING_SEARCH_ALPHAS = (0.1, 0.2, 0.3)


@dataclass(frozen=True)
class ScalingGroup:
    prev: str  # the op whose output the linears read: a norm, or a linear (its output rows are scaled)
    linears: tuple[str, ...]  # they share one input, captured at linears[0]


@dataclass(frozen=True)
class AWQCalibrationConfig:
    group_size: int = 128
    clip: bool = True  # the weight-clipping search
    duo_scaling: bool = True  # s = mean|x|^a / mean_w^(1 - a) (AutoAWQ's default); False: mean|x|^a (the paper)
    batch_size: int = 8  # calibration samples per layer forward (bounds activation memory)
    next_inputs_from_quantized: bool = True  # False: the float layer's output feeds the next layer (AutoAWQ)
    rounding: str = "rtn"  # "rtn": round to nearest (AWQ); "gptq": error-compensated (awq_gptq.py)
    gptq_damp: float = DAMP_FRACTION  # GPTQ's H + damp * mean(diag H) * I
    group_search: bool = False  # each group's (scale, zero) by output error (supersedes the clip search)
    true_sequential: bool = False  # each linear rounded for the inputs the already rounded ones give it
    refine_sweeps: int = 0  # coordinate-descent sweeps over q and the scales on the output error (awq_refine)
    refine_damp: float = REFINE_DAMP  # the refinement's H + damp * mean(diag H) * I
    scale_search: str = "rtn"  # how a scaling group's s is chosen (`SCALE_SEARCHES`)

    def __post_init__(self):
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.scale_search not in SCALE_SEARCHES:
            raise ValueError(f"scale_search must be one of {SCALE_SEARCHES}, got {self.scale_search!r}")
        if not isinstance(self.refine_sweeps, int) or isinstance(self.refine_sweeps, bool) or self.refine_sweeps < 0:
            raise ValueError(f"refine_sweeps must be a non-negative integer, got {self.refine_sweeps!r}")
        if not self.refine_damp >= 0:
            raise ValueError(f"refine_damp must be >= 0, got {self.refine_damp}")
        if not 0 < self.gptq_damp < 1:
            raise ValueError(f"gptq_damp must be in (0, 1), got {self.gptq_damp}")


def scaling_groups(layer: nn.Module) -> list[ScalingGroup]:
    """The four AWQ scaling groups of a Llama-family decoder layer (v -> o only without GQA)."""
    groups = [ScalingGroup("input_layernorm", ATTN_LINEARS[:3])]
    v, o = layer.get_submodule("self_attn.v_proj"), layer.get_submodule("self_attn.o_proj")
    if v.weight.shape == o.weight.shape:
        groups.append(ScalingGroup("self_attn.v_proj", ("self_attn.o_proj",)))
    groups += [ScalingGroup("post_attention_layernorm", MLP_LINEARS[:2]),
               ScalingGroup("mlp.up_proj", ("mlp.down_proj",))]
    return groups


def choose_group_size(hf_config, requested: int | None) -> int:
    """`requested` checked against the model's linears (in % G == 0, G a positive multiple of 32), or None
    -> the largest of 128 / 64 / 32 that fits. Also checks out_features % 8 (AWQ packs 8 outputs per int32)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    in_features = {hf_config.hidden_size, hf_config.num_attention_heads * head_dim, hf_config.intermediate_size}
    out_features = in_features | {hf_config.num_key_value_heads * head_dim}
    if any(n % AWQ_PACK_FACTOR for n in out_features):
        raise ValueError(f"AWQ needs every linear's out_features % {AWQ_PACK_FACTOR} == 0; this model has "
                         f"{sorted(out_features)}")
    fits = [g for g in GROUP_SIZE_CHOICES if all(n % g == 0 for n in in_features)]
    if requested is None:
        if not fits:
            raise ValueError(f"no AWQ group size in {GROUP_SIZE_CHOICES} divides the in_features {sorted(in_features)}")
        return fits[0]
    if requested <= 0 or requested % 32 or any(n % requested for n in in_features):
        raise ValueError(f"group_size={requested} must be a positive multiple of 32 dividing every linear's "
                         f"in_features {sorted(in_features)}; sizes that fit: {fits}")
    return requested


def causal_mask(seq_len: int, batch: int) -> torch.Tensor:
    """Additive float mask [batch, 1, seq, seq] (works with the eager and sdpa attention of transformers)."""
    upper = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    mask = torch.zeros(seq_len, seq_len).masked_fill(upper, torch.finfo(torch.float32).min)
    return mask.expand(batch, 1, seq_len, seq_len)


# which linear's captured input each linear reads (q/k/v share one input, as do gate/up)
INPUT_OWNER = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
               "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
               "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}
CAPTURED_INPUTS = tuple(dict.fromkeys(INPUT_OWNER.values()))
# (inputs captured for the stage, linears it rounds): all at once, or true-sequential in the forward's order
ONE_STAGE = ((CAPTURED_INPUTS, LAYER_LINEARS),)
SEQUENTIAL_STAGES = ((CAPTURED_INPUTS, ATTN_LINEARS[:3]), (("self_attn.o_proj",), ATTN_LINEARS[3:]),
                     (("mlp.gate_proj", "mlp.down_proj"), MLP_LINEARS[:2]), (("mlp.down_proj",), MLP_LINEARS[2:]))


class LayerRunner:
    """Runs one HF decoder layer over all calibration samples in batches, optionally summarizing the inputs
    of some of its linears (`InputStats`)."""

    def __init__(self, rotary_emb: nn.Module, seq_len: int, batch_size: int):
        self.rotary_emb, self.seq_len, self.batch_size = rotary_emb, seq_len, batch_size

    def _kwargs(self, hidden: torch.Tensor) -> dict:
        position_ids = torch.arange(self.seq_len).expand(hidden.shape[0], -1)
        return dict(attention_mask=causal_mask(self.seq_len, hidden.shape[0]), position_ids=position_ids,
                    position_embeddings=self.rotary_emb(hidden, position_ids))

    def forward(self, layer: nn.Module, hidden: torch.Tensor,
                capture: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict[str, InputStats]]:
        """hidden [samples, seq, hidden] -> (layer output [samples, seq, hidden], {linear: its input's stats})."""
        stats = {name: InputStats.empty(layer.get_submodule(name).in_features) for name in capture}
        hooks = [layer.get_submodule(name).register_forward_hook(
            lambda _m, args, _out, name=name: stats[name].add(args[0])) for name in capture]
        outs = []
        try:
            for lo in range(0, hidden.shape[0], self.batch_size):
                chunk = hidden[lo:lo + self.batch_size]
                out = layer(chunk, **self._kwargs(chunk))
                outs.append(out[0] if isinstance(out, tuple) else out)
        finally:
            for h in hooks:
                h.remove()
        return torch.cat(outs), stats


def fold_scales(layer: nn.Module, group: ScalingGroup, s: torch.Tensor, stats: dict[str, InputStats]) -> None:
    """prev / s, consumers' input columns * s, the consumers' input stats for x / s: the float layer is unchanged."""
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias.div_(s)
    else:  # RMSNorm: y = w * x / rms(x)
        prev.weight.div_(s)
    for name in group.linears:
        layer.get_submodule(name).weight.mul_(s.view(1, -1))
    stats[INPUT_OWNER[group.linears[0]]].divide_inputs(s)


def calibrate_layer(layer: nn.Module, stats: dict[str, InputStats], config: AWQCalibrationConfig,
                    recapture: Callable[[tuple[str, ...]], dict[str, InputStats]] | None = None) -> tuple[
        dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, list[float]]]:
    """Scale search + folding, clip search, quantization of one layer, in place: afterwards every linear's
    weight is its dequantized AWQ weight. `stats`: the captured inputs (`CAPTURED_INPUTS`; updated by folding).
    `recapture(names)`: the current layer's inputs of those linears, needed by `config.true_sequential`
    (each stage after the first re-captures its inputs; a scaling group is searched and folded in the first
    stage that rounds its previous op or its linears).
    Returns ({linear: (qweight, qzeros, scales)}, {group prev: scale-search losses, RTN's first})."""
    if config.true_sequential and recapture is None:
        raise ValueError("true_sequential calibration needs recapture (the layer's inputs after each stage)")
    stages = SEQUENTIAL_STAGES if config.true_sequential else ONE_STAGE
    pending = scaling_groups(layer)
    losses, quantized = {}, {}
    with torch.no_grad():
        for index, (captures, linears) in enumerate(stages):
            if index:
                stats = {**stats, **recapture(captures)}
            for group in [g for g in pending if g.prev in linears or g.linears[0] in linears]:
                s, losses[group.prev] = choose_scale(layer, group, stats[INPUT_OWNER[group.linears[0]]], config)
                if s is not None:
                    fold_scales(layer, group, s, stats)
                pending.remove(group)
            for name in linears:
                linear = layer.get_submodule(name)
                clip = config.clip and name not in NO_CLIP_LINEARS
                quantized[name] = quantize_linear(linear.weight.data, stats[INPUT_OWNER[name]], config, clip)
                linear.weight.copy_(dequantize_awq(*quantized[name], config.group_size))
    return quantized, losses


def choose_scale(layer: nn.Module, group: ScalingGroup, stats: InputStats,
                 config: AWQCalibrationConfig) -> tuple[torch.Tensor | None, list[float]]:
    """(s [in] to fold, or None for s = 1; the search's losses, s = 1's first) of one scaling group by
    `config.scale_search`."""
    weights = [layer.get_submodule(n).weight.detach() for n in group.linears]
    if config.scale_search == "none":
        return None, [1.0]
    if config.scale_search == "rtn":
        return search_scale(stats, weights, config.group_size, duo_scaling=config.duo_scaling)
    clips = [config.clip and n not in NO_CLIP_LINEARS for n in group.linears]
    unrefined = replace(config, refine_sweeps=0)

    def rounded_error(s: torch.Tensor) -> float:
        scaled = stats.scaled(s)
        total = 0.0
        for w, clip in zip(weights, clips):
            ws = w.to(torch.float32) * s
            wq = dequantize_awq(*quantize_linear(ws, scaled, unrefined, clip), config.group_size)
            total += output_error(scaled.gram, wq - ws)
        return total

    s, losses = search_scale_by_rounding(stats, weights, config.group_size, rounded_error,
                                         ROUNDING_SEARCH_ALPHAS, duo_scaling=config.duo_scaling)
    return (None if bool((s == 1).all()) else s), losses


def quantize_linear(w: torch.Tensor, stats: InputStats, config: AWQCalibrationConfig, clip: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] (scales folded) -> AutoAWQ's (qweight, qzeros, scales) by `config.rounding`, `clip`: the
    clip search (RTN: once on W; GPTQ: per group on its error-updated weights), unless `config.group_search`
    chooses every group's (scale, zero) instead; then `config.refine_sweeps` of `refine_rounding` towards W."""
    G = config.group_size
    if config.rounding == "gptq":
        groups = gptq_quantize(w, stats.gram, G, clip=clip, group_search=config.group_search, damp=config.gptq_damp)
    elif config.group_search:
        groups = search_quantize(w, stats.gram, G)
    else:
        packed = quantize_awq(apply_clip(w, *search_clip(stats, w, G), G) if clip else w, G)
        if not config.refine_sweeps:
            return packed
        groups = (unpack_awq_int4(packed[0]).t(), unpack_awq_int4(packed[1]).t(), packed[2].t())
    if config.refine_sweeps:
        groups = refine_rounding(w, *groups, stats.gram, G, sweeps=config.refine_sweeps, damp=config.refine_damp)
    return pack_awq(*groups)


def load_float_model(model_dir: str):
    """HF transformers' CausalLM from an HF directory in float32, eval mode; refuses unsupported families."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"AWQ calibration supports model types {SUPPORTED_MODEL_TYPES}; {model_dir} is "
                         f"{cfg.model_type!r}")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def calibrate_model(model, samples: list[list[int]], config: AWQCalibrationConfig,
                    progress: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
    """AWQ over every decoder layer of an HF float32 CausalLM `model` (modified in place: folded norms,
    dequantized AWQ linears), on `samples` (equal-length token-id lists). Returns the checkpoint tensors by
    HF name: `<linear>.qweight` / `.qzeros` / `.scales` for the decoder linears, float for everything else."""
    ids = torch.tensor(samples, dtype=torch.long)
    inner = model.model
    runner = LayerRunner(inner.rotary_emb, ids.shape[1], config.batch_size)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        hidden = inner.embed_tokens(ids)
        for i, layer in enumerate(inner.layers):
            start = time.perf_counter()
            float_out, stats = runner.forward(layer, hidden, CAPTURED_INPUTS)
            quantized, losses = calibrate_layer(
                layer, stats, config, lambda names, layer=layer: runner.forward(layer, hidden, names)[1])
            del stats
            hidden = runner.forward(layer, hidden)[0] if config.next_inputs_from_quantized else float_out
            prefix = f"model.layers.{i}."
            for name, (qweight, qzeros, scales) in quantized.items():
                tensors.update({prefix + name + ".qweight": qweight, prefix + name + ".qzeros": qzeros,
                                prefix + name + ".scales": scales})
            for name, p in layer.named_parameters():
                if name.removesuffix(".weight") not in LAYER_LINEARS:
                    tensors[prefix + name] = p.detach().clone()
            if progress is not None:
                gain = ", ".join(f"{g}: {min(v) / max(v[0], 1e-30):.2f}" for g, v in losses.items())
                progress(f"layer {i + 1}/{len(inner.layers)} done in {time.perf_counter() - start:.1f}s "
                         f"(scale-search loss vs RTN: {gain})")
    for name, p in model.state_dict().items():
        if not name.startswith("model.layers.") and not (name == "lm_head.weight" and _tied(model)):
            tensors[name] = p.detach().clone()
    return tensors


def _tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))
