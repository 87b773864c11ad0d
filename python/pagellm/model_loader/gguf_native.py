"""Loading a .gguf file's quantized linear weights natively (quantization="gguf"), straight from the file.

The model's config and tokenizer still come from the converted HF directory (gguf_convert.py); the
weights are read from the .gguf itself:

- decoder linears (attn_q/k/v/output, ffn_gate/up/down) stored as Q8_0, Q4_0, Q4_1, Q4_K or Q6_K are
  yielded as `<hf module>.qweight`, uint8 [out, in / block_elems * block_bytes], the file's rows as they are
  (q/k rows un-permuted as gguf_convert.unpermute_qk does: a row of blocks moves as a unit), for
  `pagellm.quantization.gguf.GGUFLinearMethod`;
- the token embedding and an untied LM head (token_embd, output) stored in one of those types are yielded
  the same way (`model.embed_tokens.qweight`, `lm_head.qweight`) for `GGUFEmbeddingMethod`; in any other
  type they are dequantized (not refused);
- a merged layer (qkv_proj, gate_up_proj) whose shards are stored in different block types (Q4_K_M files keep
  attn_v in Q6_K and attn_q / attn_k in Q4_K in some layers) keeps each shard's blocks
  (`GGUFMixedLinearMethod`: one op call per shard); one that mixes a float shard with block shards is
  dequantized, that layer only, and named in the log;
- every other tensor (norms, and linears stored as F32/F16/BF16) is dequantized to float32 exactly as the
  default path does, and loads into an ordinary float parameter.

`plan_native_gguf` reads only the file's tensor directory (GGUFReader memory-maps it), so a tensor type
that cannot be used natively is refused (ValueError naming it and the supported types) before the model
is built.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from pagellm.distributed import get_tp_size
from pagellm.logger import init_logger
from pagellm.model_loader.gguf_convert import _SKIP, dequantize_tensor, gguf_name_to_hf, unpermute_qk
from pagellm.quantization.gguf import GGUF_METHOD, GGUFConfig, supported_gguf_types

logger = init_logger(__name__)

# GGUF tensor kinds that are decoder linear layers (the rest are norms, embedding, LM head)
_LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_FLOAT_TYPES = ("F32", "F16", "BF16")
# GGUF tensors of the vocabulary-sized layers -> the model's layer prefix
_VOCAB_LAYERS = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}


@dataclass
class NativeGGUFPlan:
    """What loading `path` natively needs: the quantization config and, per GGUF tensor, how it loads."""

    path: Path
    reader: Any                     # the gguf.GGUFReader (parsing its metadata takes seconds: done once)
    quant_config: GGUFConfig
    n_head: int
    n_kv_head: int
    native_tensors: set[str] = field(default_factory=set)  # GGUF names loaded as qweight blocks
    dequantized_layers: dict[str, dict[str, str]] = field(default_factory=dict)  # float + block shards -> types

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor of the file, one at a time."""
        for t in self.reader.tensors:
            if t.name in _SKIP:
                continue
            hf_name = gguf_name_to_hf(t.name)
            if hf_name is None:
                raise ValueError(f"{self.path}: unexpected tensor {t.name!r} for a llama GGUF")
            if t.name in self.native_tensors:
                yield hf_name.removesuffix(".weight") + ".qweight", self._blocks(t.name, np.asarray(t.data))
            else:
                yield hf_name, self._rows(t.name, dequantize_tensor(t))

    def _blocks(self, name: str, rows: np.ndarray) -> torch.Tensor:
        """A native tensor's blocks: under tensor parallelism a view of the file's memory map (the layer copies
        only this rank's rows / blocks out of it, parallel_linear), unless q/k rows must be reordered first."""
        if get_tp_size() == 1 or ".attn_q." in name or ".attn_k." in name:
            return self._rows(name, rows)
        with warnings.catch_warnings():  # read-only map: the loaders only copy out of it, never write
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(rows)

    def _rows(self, name: str, rows: np.ndarray) -> torch.Tensor:
        if ".attn_q." in name:
            rows = unpermute_qk(rows, self.n_head)
        elif ".attn_k." in name:
            rows = unpermute_qk(rows, self.n_kv_head)
        return torch.from_numpy(np.array(rows, copy=True))  # off the read-only memory map


def _linear_kind(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_KINDS and parts[3] == "weight":
        return parts[2]
    return None


def _param_prefix(hf_name: str, stacked_params_mapping) -> tuple[str, object]:
    """HF module name of a linear weight -> (the model's layer prefix, shard id or None), e.g.
    "model.layers.0.self_attn.q_proj.weight" -> ("model.layers.0.self_attn.qkv_proj", "q")."""
    module = hf_name.removesuffix(".weight")
    for merged, hf, shard in stacked_params_mapping:
        if module.endswith(f".{hf}"):
            return module.removesuffix(hf) + merged, shard
    return module, None


def plan_native_gguf(gguf_path: Path, model_cls, hf_config) -> NativeGGUFPlan:
    """Check every tensor type of `gguf_path` and build the GGUFConfig for `model_cls` (whose
    `stacked_params_mapping` says which HF linears share a merged layer): decoder linears, the token embedding
    and an untied LM head in a supported block type stay blocks, a merged layer's shards too when they differ in
    block type; a merged layer mixing float and block shards is dequantized (`dequantized_layers`). Raises
    ValueError for a linear stored in a type without a native kernel."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    layer_types: dict[str, str | dict] = {}
    native: set[str] = set()
    shard_types: dict[str, dict[str, tuple[object, str]]] = {}  # layer prefix -> {GGUF name: (shard id, type)}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if t.name in _VOCAB_LAYERS and type_name in supported_gguf_types():
            layer_types[_VOCAB_LAYERS[t.name]] = type_name
            native.add(t.name)
        if _linear_kind(t.name) is None:
            continue
        if type_name not in _FLOAT_TYPES and type_name not in supported_gguf_types():
            raise ValueError(f"{gguf_path}: tensor {t.name!r} is stored as {type_name}, which has no native kernel; "
                             f"supported with quantization={GGUF_METHOD!r}: {supported_gguf_types()} (and float "
                             f"{list(_FLOAT_TYPES)}); load it without quantization= to dequantize it instead")
        prefix, shard_id = _param_prefix(gguf_name_to_hf(t.name), model_cls.stacked_params_mapping)
        shard_types.setdefault(prefix, {})[t.name] = (shard_id, type_name)
    dequantized: dict[str, dict[str, str]] = {}
    for prefix, shards in shard_types.items():
        types = {type_name for _, type_name in shards.values()}
        if types & set(_FLOAT_TYPES):
            if len(types) > 1:
                dequantized[prefix] = {name: type_name for name, (_, type_name) in shards.items()}
            continue
        layer_types[prefix] = types.pop() if len(types) == 1 else {sid: t for sid, t in shards.values()}
        native.update(shards)
    if dequantized:
        logger.info("%s: %d merged layer(s) mix float and block shards and are dequantized (float weights): %s",
                    gguf_path, len(dequantized), ", ".join(dequantized))
    if not layer_types:
        raise ValueError(f"{gguf_path}: no tensor is stored as {supported_gguf_types()}; nothing to load "
                         f"natively with quantization={GGUF_METHOD!r}")
    n_head = hf_config.num_attention_heads
    n_kv_head = getattr(hf_config, "num_key_value_heads", None) or n_head
    return NativeGGUFPlan(Path(gguf_path), reader, GGUFConfig(layer_types), n_head, n_kv_head, native, dequantized)
