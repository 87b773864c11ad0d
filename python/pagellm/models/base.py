"""Shared machinery for decoder-only causal LMs: HF-name weight loading and KV-cache introspection."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from pagellm.attention.base import AttentionLayerSpec
from pagellm.distributed.pipeline import absent_prefixes
from pagellm.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SharedKVSpec, SlidingWindowSpec
from pagellm.layers.attention import Attention
from pagellm.layers.linear import MergedLinear, WeightShapeError, default_weight_loader
from pagellm.layers.moe import EXPERT_SHARDS, FusedMoE

_PER_EXPERT_NAME = re.compile(r"(.+\.experts)\.(\d+)\.([^.]+)\.weight")  # model.layers.0.mlp.experts.3.w1.weight
# transformers 5.x's stacked expert tensors ([E, 2I, H] / [E, H, I]) -> the FusedMoE parameter they fill
_STACKED_EXPERT_PARAMS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


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
    # MoE models: HF's per-expert linear name -> FusedMoE shard ("gate" / "up" / "down"), e.g. Mixtral
    # {"w1": "gate", "w3": "up", "w2": "down"}: `...experts.{e}.w1.weight` loads into `...experts.w13_weight`
    expert_params_mapping: dict[str, str] = {}

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
        for a layer with a window, a SharedKVSpec for one reading another layer's cache, a FullAttentionSpec
        otherwise. `dtype`: a float torch dtype or a quantized cache dtype name ("int8", "fp8_e4m3")."""
        def spec(a: AttentionLayerSpec) -> KVCacheSpec:
            if not a.writes_kv:
                return SharedKVSpec(a.kv_source_layer)
            if a.window_size > 0:
                return SlidingWindowSpec(block_size, a.num_kv_heads, a.head_dim, dtype, a.window_size)
            return FullAttentionSpec(block_size, a.num_kv_heads, a.head_dim, dtype)

        return {a.layer_idx: spec(a) for a in self.attention_specs()}

    # ---- weights -------------------------------------------------------------------------------
    def _hf_to_expert_param(self, name: str) -> tuple[str, int | None, str | None] | None:
        """(FusedMoE parameter, expert id, shard) for an expert tensor; (parameter, None, None) for a stacked one."""
        if not self.expert_params_mapping:
            return None
        m = _PER_EXPERT_NAME.fullmatch(name)
        if m and m[3] in self.expert_params_mapping:
            shard = self.expert_params_mapping[m[3]]
            return f"{m[1]}.{EXPERT_SHARDS[shard]}", int(m[2]), shard
        module, _, leaf = name.rpartition(".")
        if module.endswith(".experts") and leaf in _STACKED_EXPERT_PARAMS:
            return f"{module}.{_STACKED_EXPERT_PARAMS[leaf]}", None, None
        return None

    def _per_expert_names(self, param_name: str, num_experts: int) -> set[str]:
        """The HF per-expert names a FusedMoE parameter (`...experts.w13_weight`) is loaded from."""
        module, _, leaf = param_name.rpartition(".")
        return {f"{module}.{e}.{hf}.weight" for hf, shard in self.expert_params_mapping.items()
                if EXPERT_SHARDS[shard] == leaf for e in range(num_experts)}

    def _load_expert_tensor(self, name: str, tensor: torch.Tensor, params: dict, expert: tuple) -> set[str]:
        """Load one expert tensor; the HF names it stands for (a stacked tensor: every expert's)."""
        pname, expert_id, shard = expert
        param = params.get(pname)
        if param is None:
            raise WeightLoadError(name, f"unexpected tensor: {type(self).__name__} has no parameter for it")
        try:
            param.weight_loader(param, tensor, expert_id, shard)
        except WeightShapeError as e:
            raise WeightLoadError(name, str(e)) from None
        if expert_id is not None:
            return {name}
        return self._per_expert_names(pname, param.shape[0])

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
            if isinstance(mod, FusedMoE):
                names |= self._per_expert_names(pname, mod.num_experts)
            elif isinstance(mod, MergedLinear):
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
        other_stages = absent_prefixes(self)  # a pipeline stage skips (and so never reads) the others' tensors
        for name, tensor in weights:
            if name.endswith(self.ignored_weight_suffixes) or (other_stages and name.startswith(other_stages)):
                continue
            if self.tie_word_embeddings and name.startswith("lm_head."):
                continue  # tied: the embedding provides it (HF ignores it too)
            expert = self._hf_to_expert_param(name)
            if expert is not None:
                loaded |= self._load_expert_tensor(name, tensor, params, expert)
                continue
            pname, shard = self._hf_to_param(name)
            param = params.get(pname)
            if param is None and name in params:  # an unmerged layer with an HF name (a KV-sharing layer's q_proj)
                pname, shard, param = name, None, params[name]
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
