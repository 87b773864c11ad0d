"""Llama (and Mistral, same code with a sliding window). Qwen2/Qwen3 reuse these blocks.

Op order follows transformers' LlamaForCausalLM so float32 results match it.
"""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn

from pagellm.distributed import get_pp_state, get_tp_state
from pagellm.distributed.pipeline import (
    StageAbsent, check_kv_sharing_within_stages, recv_activations, send_activations,
)
from pagellm.distributed.sharding import partition_heads
from pagellm.layers.activation import get_act_and_mul
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import LMHead, VocabEmbedding
from pagellm.layers.folded import FoldedRows, fold_act, fold_norm
from pagellm.layers.linear import Linear, MergedLinear, QKVLinear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import get_rope_from_config
from pagellm.models.base import CausalLMBase
from pagellm.models.kv_sharing import resolve_kv_sharing
from pagellm.models.registry import register_model


def config_head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_window_size(config, layer_idx: int) -> int:
    """Keys a query sees in layer `layer_idx` (itself included); -1 = full attention.

    transformers 5.x configs list `layer_types` ("sliding_attention"/"full_attention"); older ones
    have `use_sliding_window` + `max_window_layers` (Qwen: layers >= max_window_layers slide) or a
    bare `sliding_window` (Mistral: every layer).
    """
    window = getattr(config, "sliding_window", None)
    if not window:
        return -1
    if getattr(config, "use_sliding_window", True) is False:
        return -1
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return int(window) if layer_types[layer_idx] == "sliding_attention" else -1
    max_window_layers = getattr(config, "max_window_layers", None)
    if max_window_layers is not None and hasattr(config, "use_sliding_window"):
        return int(window) if layer_idx >= max_window_layers else -1
    return int(window)


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias, dtype=dtype,
                                         quant_config=quant_config, prefix=f"{prefix}.gate_up_proj", tp_mode="column")
        self.down_proj = Linear(inter, config.hidden_size, bias=bias, dtype=dtype, quant_config=quant_config,
                                prefix=f"{prefix}.down_proj", tp_mode="row")
        self.act_fn = get_act_and_mul(config.hidden_act)

    @property
    def input_linear(self) -> nn.Module:
        """The linear that reads the MLP's input (a norm before the MLP may fold into it: layers/folded.py)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor | FoldedRows) -> torch.Tensor:
        return self.down_proj(fold_act(self.act_fn, self.gate_up_proj(x), self.down_proj))


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3: RMSNorm over each head of q and k, before rope

    @staticmethod
    def qkv_bias(config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def o_bias(config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, window_size: int = -1, quant_config=None,
                 prefix: str = "", kv_source_layer: int = -1) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        tp = get_tp_state()  # this rank's heads (all of them on a single rank)
        heads = partition_heads(total_heads, total_kv_heads, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = config_head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.writes_kv = kv_source_layer < 0
        if self.writes_kv:
            self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                      bias=self.qkv_bias(config), dtype=dtype, quant_config=quant_config,
                                      prefix=f"{prefix}.qkv_proj", tp_mode="column")
        else:  # reads layer kv_source_layer's cache: no k/v projections (HF name q_proj, nothing merged)
            self.q_proj = Linear(config.hidden_size, total_heads * self.head_dim, bias=self.qkv_bias(config),
                                 dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.q_proj", tp_mode="column")
        self.o_proj = Linear(total_heads * self.head_dim, config.hidden_size, bias=self.o_bias(config), dtype=dtype,
                             quant_config=quant_config, prefix=f"{prefix}.o_proj", tp_mode="row")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, dtype=dtype)
            if self.writes_kv:
                self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = get_rope_from_config(config, self.head_dim, dtype=dtype)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=self.head_dim**-0.5, window_size=window_size, kv_source_layer=kv_source_layer)

    @property
    def input_linear(self) -> nn.Module:
        """The linear that reads the layer's input (a norm before attention may fold into it: layers/folded.py)."""
        return self.qkv_proj if self.writes_kv else self.q_proj

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | FoldedRows, ctx) -> torch.Tensor:
        if not self.writes_kv:
            return self._forward_shared_kv(positions, hidden, ctx)
        # q, k, v are strided views of the merged output: rope, the cache write and attention take
        # row strides, so nothing is copied. The attention layer applies the rope (with the cache write, where the
        # backend does both in one kernel).
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        T = q.shape[0]
        if self.qk_norm:
            q = self.q_norm(q.reshape(T * self.num_heads, self.head_dim)).view(T, self.q_size)
            k = self.k_norm(k.reshape(T * self.num_kv_heads, self.head_dim)).view(T, self.kv_size)
        return self.o_proj(self.attn(q, k, v, ctx, rope=(self.rotary_emb, positions)))

    def _forward_shared_kv(self, positions: torch.Tensor, hidden: torch.Tensor | FoldedRows, ctx) -> torch.Tensor:
        q = self.q_proj(hidden)
        T = q.shape[0]
        if self.qk_norm:
            q = self.q_norm(q.reshape(T * self.num_heads, self.head_dim)).view(T, self.q_size)
        # the rope op rotates a query and a key together: a one-head scratch key stands in for the missing one
        q, _ = self.rotary_emb(positions, q, q.new_empty(T, self.head_dim))
        return self.o_proj(self.attn(q, None, None, ctx))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP

    def __init__(self, config, layer_idx: int, dtype: torch.dtype, window_size: int = -1, quant_config=None,
                 prefix: str = "", kv_source_layer: int = -1) -> None:
        super().__init__()
        shared = {"kv_source_layer": kv_source_layer} if kv_source_layer >= 0 else {}
        self.self_attn = self.attention_cls(config, layer_idx, dtype, window_size, quant_config=quant_config,
                                            prefix=f"{prefix}.self_attn", **shared)
        self.mlp = self.mlp_cls(config, dtype, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, positions, hidden, residual, ctx):
        # each norm (and the residual add before it) is computed here, or folded into the CUDA GEMV of the linear
        # that reads it (layers/folded.py: one kernel instead of two in a decode step); without a residual (the
        # first layer) the residual is the layer's input
        hidden, residual = fold_norm(self.input_layernorm, hidden, residual, self.self_attn.input_linear)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = fold_norm(self.post_attention_layernorm, hidden, residual,
                                     getattr(self.mlp, "input_linear", None))
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, dtype: torch.dtype, layer_cls: type[LlamaDecoderLayer], window_fn, quant_config=None,
                 prefix: str = "model", kv_sharing: dict[int, int] | None = None) -> None:
        super().__init__()
        kv_sharing = kv_sharing or {}
        # a pipeline stage (pagellm.distributed.pipeline) builds its own layers only; StageAbsent keeps the
        # others' HF names so the loader skips their tensors. A single stage builds everything.
        pp = get_pp_state()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.start_layer = pp.layer_start
        self.end_layer = config.num_hidden_layers if pp.layer_end is None else pp.layer_end
        tied_head_here = pp.is_last_stage and bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = (VocabEmbedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                            quant_config=quant_config, prefix=f"{prefix}.embed_tokens")
                             if pp.is_first_stage or tied_head_here else StageAbsent("embed_tokens"))
        self.layers = nn.ModuleList(
            [layer_cls(config, i, dtype, window_fn(config, i), quant_config=quant_config,
                       prefix=f"{prefix}.layers.{i}", **({"kv_source_layer": kv_sharing[i]} if i in kv_sharing else {}))
             if self.start_layer <= i < self.end_layer else StageAbsent(f"layer {i}")
             for i in range(config.num_hidden_layers)]
        )
        self.norm = (RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype) if pp.is_last_stage
                     else StageAbsent("norm"))

    def forward(self, input_ids, positions, ctx):
        """[T] ids -> [T, H] final hidden states (a stage before the last: its layers' output, sent on)."""
        pp = get_pp_state()
        if pp.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = recv_activations(input_ids.shape[0], self.hidden_size, self.dtype, input_ids.device)
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(positions, hidden, residual, ctx)
        if not pp.is_last_stage:
            send_activations(hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(CausalLMBase):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config, dtype: torch.dtype = torch.float32, quant_config=None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.quant_config = quant_config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # sharing layer -> target (kv_sharing.py), checked before anything is allocated
        self.kv_sharing = resolve_kv_sharing(config, config.num_hidden_layers, self._kv_cache_kind)
        check_kv_sharing_within_stages(self.kv_sharing)
        self.model = LlamaModel(config, dtype, self.layer_cls, self.window_size_for_layer, quant_config=quant_config,
                                kv_sharing=self.kv_sharing)
        self.lm_head = (LMHead(config.vocab_size, config.hidden_size, dtype=dtype,
                               tied_to=self.model.embed_tokens if self.tie_word_embeddings else None,
                               quant_config=quant_config, prefix="lm_head")
                        if get_pp_state().is_last_stage else StageAbsent("lm_head"))

    @staticmethod
    def window_size_for_layer(config, layer_idx: int) -> int:
        return layer_window_size(config, layer_idx)

    def _kv_cache_kind(self, layer_idx: int) -> tuple[int, int, int]:
        """What a layer's cache must match to be shared: (num_kv_heads, head_dim, window)."""
        c = self.config
        num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return num_kv_heads, config_head_dim(c), self.window_size_for_layer(c, layer_idx)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def compute_greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits(hidden).argmax(-1) as int64 [N] without the logits where the LM head can (None: it can't)."""
        return self.lm_head.greedy_token_ids(hidden)


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    """Llama with `sliding_window` on every layer (-> AttentionLayerSpec.window_size)."""
