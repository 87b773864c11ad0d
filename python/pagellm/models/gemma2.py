"""Gemma 2: interleaved sliding-window / global layers, attention and final logit soft-capping.

Differences from Llama, op order as transformers' Gemma2ForCausalLM so float32 results match it:
- RMSNorm is x * (1 + w) (GemmaRMSNorm stores 1 + w), and each layer has four: input, post-attention (on the
  attention output, before the residual add), pre-feedforward and post-feedforward (on the MLP output).
- the embedding output is scaled by sqrt(hidden_size), rounded to the model dtype first (as HF does);
- attention scale query_pre_attn_scalar ** -0.5; scores soft-capped by attn_logit_softcapping;
- logits soft-capped by final_logit_softcapping; gelu_pytorch_tanh gated MLP; tied embeddings by default.

Sliding layers see `sliding_window` keys (themselves included: HF's mask is kv_idx > q_idx - window); their
KV blocks stay allocated and the window is a mask (see kv_cache/groups.py for what freeing them needs).
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed import get_pp_state, get_tp_state
from pagellm.distributed.pipeline import StageAbsent, recv_activations, send_activations
from pagellm.distributed.sharding import partition_heads
from pagellm.layers.activation import get_act_and_mul
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import LMHead, VocabEmbedding
from pagellm.layers.linear import Linear, MergedLinear, QKVLinear
from pagellm.layers.norm import GemmaRMSNorm
from pagellm.layers.rotary import get_rope_from_config
from pagellm.models.base import CausalLMBase
from pagellm.models.llama import config_head_dim, layer_window_size
from pagellm.models.registry import register_model

LAYER_TYPES = ("sliding_attention", "full_attention")


def check_gemma_config(config) -> None:
    """ValueError naming the field for what these models cannot serve; called before anything is built."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries, but num_hidden_layers is "
                             f"{config.num_hidden_layers}: one entry per layer is needed")
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"config.layer_types: unknown layer type(s) {bad}; allowed: {list(LAYER_TYPES)}")
        if "sliding_attention" in layer_types and not (getattr(config, "sliding_window", None) or 0) > 0:
            raise ValueError(f"config.sliding_window must be a positive integer for sliding_attention layers, "
                             f"got {getattr(config, 'sliding_window', None)!r}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("config.use_bidirectional_attention=True (an embedding model) is not supported; "
                         "only causal attention is")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar is not None and not scalar > 0:
        raise ValueError(f"config.query_pre_attn_scalar must be > 0, got {scalar!r}")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = getattr(config, field, None)
        if cap is not None and not cap > 0:
            raise ValueError(f"config.{field} must be > 0 or null (off), got {cap!r}")


def checked_rope(config, head_dim: int, dtype: torch.dtype, field: str = "rope_parameters"):
    """get_rope_from_config with a ValueError that names the config field (unknown rope type, missing keys)."""
    try:
        return get_rope_from_config(config, head_dim, dtype=dtype)
    except (ValueError, KeyError) as e:
        raise ValueError(f"config.{field}: {e}") from None


class GemmaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act = hidden_activation (gelu_pytorch_tanh); no biases."""

    def __init__(self, config, dtype: torch.dtype, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=False, dtype=dtype,
                                         quant_config=quant_config, prefix=f"{prefix}.gate_up_proj", tp_mode="column")
        self.down_proj = Linear(inter, config.hidden_size, bias=False, dtype=dtype, quant_config=quant_config,
                                prefix=f"{prefix}.down_proj", tp_mode="row")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self.act_fn = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(nn.Module):
    """forward(positions [T], hidden [T, hidden_size], ctx) -> [T, hidden_size]. Subclasses choose the rope
    (`make_rope`), the score soft-cap (`attn_softcap`) and whether q and k are normalized per head."""

    qk_norm = False  # Gemma 3: GemmaRMSNorm over each head of q and k, before rope

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, window_size: int = -1, quant_config=None,
                 prefix: str = "") -> None:
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        tp = get_tp_state()  # this rank's heads (all of them on a single rank); soft-caps and norms are per head
        heads = partition_heads(total_heads, total_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = config_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=bias,
                                  dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.qkv_proj", tp_mode="column")
        self.o_proj = Linear(total_heads * self.head_dim, config.hidden_size, bias=bias, dtype=dtype,
                             quant_config=quant_config, prefix=f"{prefix}.o_proj", tp_mode="row")
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps, dtype=dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = self.make_rope(config, layer_idx, dtype)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=float(config.query_pre_attn_scalar) ** -0.5, window_size=window_size,
                              softcap=self.attn_softcap(config))

    def make_rope(self, config, layer_idx: int, dtype: torch.dtype):
        return checked_rope(config, self.head_dim, dtype)

    @staticmethod
    def attn_softcap(config) -> float:
        return float(getattr(config, "attn_logit_softcapping", None) or 0.0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        T = hidden.shape[0]
        if self.qk_norm:
            q = self.q_norm(q.reshape(T * self.num_heads, self.head_dim)).view(T, self.q_size)
            k = self.k_norm(k.reshape(T * self.num_kv_heads, self.head_dim)).view(T, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, ctx))


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, window_size: int = -1, quant_config=None,
                 prefix: str = "") -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, dtype, window_size, quant_config=quant_config,
                                            prefix=f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, dtype, quant_config=quant_config, prefix=f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)

    def forward(self, positions, hidden, residual, ctx):
        """hidden: the previous layer's post-feedforward output, still to be added to `residual` (None in
        layer 0: hidden is the scaled embedding). Returns (this layer's post-feedforward output, residual)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, ctx))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(nn.Module):
    """A pipeline stage (pagellm.distributed.pipeline) builds its own layers only (others StageAbsent), the
    embedding on the first stage (and the last when the head is tied to it), the final norm on the last;
    stages pass (hidden, residual) on as the Llama model's do."""

    def __init__(self, config, dtype: torch.dtype, layer_cls: type[Gemma2DecoderLayer], quant_config=None,
                 prefix: str = "model", tied_head: bool = True) -> None:
        super().__init__()
        pp = get_pp_state()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.start_layer = pp.layer_start
        self.end_layer = config.num_hidden_layers if pp.layer_end is None else pp.layer_end
        self.embed_tokens = (VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                            quant_config=quant_config, prefix=f"{prefix}.embed_tokens")
                             if pp.is_first_stage or (pp.is_last_stage and tied_head) else StageAbsent("embed_tokens"))
        # HF rounds sqrt(hidden) to the model dtype before multiplying (55.4256 -> 55.5 in bf16)
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5, dtype=dtype), persistent=False)
        self.layers = nn.ModuleList(
            [layer_cls(config, i, dtype, layer_window_size(config, i), quant_config=quant_config,
                       prefix=f"{prefix}.layers.{i}") if self.start_layer <= i < self.end_layer
             else StageAbsent(f"layer {i}") for i in range(config.num_hidden_layers)]
        )
        self.norm = (GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype) if pp.is_last_stage
                     else StageAbsent("norm"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        pp = get_pp_state()
        if pp.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids) * self.normalizer, None
        else:
            hidden, residual = recv_activations(input_ids.shape[0], self.hidden_size, self.dtype, input_ids.device)
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual, ctx)
        if not pp.is_last_stage:
            send_activations(hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


@register_model("Gemma2ForCausalLM")
class Gemma2ForCausalLM(CausalLMBase):
    """forward(input_ids [T], positions [T], ctx) -> hidden [T, hidden]; compute_logits(hidden [N, hidden])
    -> [N, vocab], soft-capped by final_logit_softcapping when the config sets it."""

    layer_cls = Gemma2DecoderLayer

    def __init__(self, config, dtype: torch.dtype = torch.float32, quant_config=None) -> None:
        super().__init__()
        check_gemma_config(config)
        self.config = config
        self.dtype = dtype
        self.quant_config = quant_config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.model = Gemma2Model(config, dtype, self.layer_cls, quant_config=quant_config,
                                 tied_head=self.tie_word_embeddings)
        self.lm_head = (LMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                               tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
                               quant_config=quant_config, prefix="lm_head")
                        if get_pp_state().is_last_stage else StageAbsent("lm_head"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap > 0:  # HF's order: / cap, tanh, * cap (in the logits' dtype)
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
