"""Shared machinery for decoder-only causal LMs: HF-name weight loading and KV-cache introspection."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from pagellm.attention.base import AttentionLayerSpec
from pagellm.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagellm.layers.attention import Attention
from pagellm.layers.linear import MergedLinear, WeightShapeError, default_weight_loader


class WeightLoadError(ValueError):
    """A checkpoint tensor could not be loaded; `tensor_name` is its HF name (file added by the loader)."""

    def __init__(self, tensor_name: str, message: str, file: str | None = None) -> None:
        self.tensor_name = tensor_name
        self.message = message
        self.file = file
        where = f" in {file}" if file else ""
        super().__init__(f"tensor {tensor_name!r}{where}: {message}")


class CausalLMBase(nn.Module):
    """Subclasses build `self.model` / `self.lm_head` with HF parameter names, except that merged
    layers replace HF ones as listed in `stacked_params_mapping` (merged name, HF name, shard id)."""

    stacked_params_mapping: list[tuple[str, str, object]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # checkpoint tensors that are not parameters here and are dropped silently
    ignored_weight_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
    tie_word_embeddings: bool = False

    # ---- KV cache ------------------------------------------------------------------------------
    def attention_specs(self) -> list[AttentionLayerSpec]:
        specs = [m.spec for m in self.modules() if isinstance(m, Attention)]
        return sorted(specs, key=lambda s: s.layer_idx)

    @property
    def num_layers(self) -> int:
        return len(self.attention_specs())

    @property
    def num_kv_heads(self) -> int:
        return self.attention_specs()[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention_specs()[0].head_dim

    @property
    def window_sizes(self) -> list[int]:
        """Per layer: keys a query sees (itself included), -1 = full attention."""
        return [s.window_size for s in self.attention_specs()]

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype | str) -> dict[int, KVCacheSpec]:
        """Layer id -> what that layer stores per KV-cache block (pagellm.kv_cache): a SlidingWindowSpec
        for a layer with a window, a FullAttentionSpec otherwise. `dtype`: a float torch dtype or a
        quantized cache dtype name ("int8", "fp8_e4m3")."""
        def spec(a: AttentionLayerSpec) -> KVCacheSpec:
            if a.window_size > 0:
                return SlidingWindowSpec(block_size, a.num_kv_heads, a.head_dim, dtype, a.window_size)
            return FullAttentionSpec(block_size, a.num_kv_heads, a.head_dim, dtype)

        return {a.layer_idx: spec(a) for a in self.attention_specs()}

    # ---- weights -------------------------------------------------------------------------------
    def _hf_to_param(self, name: str) -> tuple[str, object]:
        for merged, hf, shard in self.stacked_params_mapping:
            key = f".{hf}."
            if key in name:
                return name.replace(key, f".{merged}.", 1), shard
        return name, None

    def expected_weight_names(self) -> set[str]:
        """HF tensor names a complete checkpoint provides for this model: one per parameter, whatever its
        LinearMethod registered (e.g. `weight` + `weight_scale`), and per shard for a merged layer's."""
        names: set[str] = set()
        modules = dict(self.named_modules())
        for pname, _ in self.named_parameters():
            mod_name, _, leaf = pname.rpartition(".")
            mod = modules.get(mod_name)
            if isinstance(mod, MergedLinear):
                merged = mod_name.rpartition(".")[2]
                for m, hf, shard in self.stacked_params_mapping:
                    if m == merged and shard in mod.shard_offsets:
                        names.add(f"{mod_name.rpartition('.')[0]}.{hf}.{leaf}")
            else:
                names.add(pname)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors via each parameter's `weight_loader`; returns the HF names loaded.

        Raises WeightLoadError on an unexpected tensor or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(self.ignored_weight_suffixes):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # tied: the embedding provides it (HF ignores it too)
            pname, shard = self._hf_to_param(name)
            param = params.get(pname)
            if param is None:
                raise WeightLoadError(name, f"unexpected tensor: {type(self).__name__} has no parameter for it")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
            except WeightShapeError as e:
                raise WeightLoadError(name, str(e)) from None
            loaded.add(name)
        return loaded
