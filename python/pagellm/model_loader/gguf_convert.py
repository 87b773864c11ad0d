"""Convert a llama-architecture GGUF file, once, into an HF-format directory in the user cache.

Tensors are read with the `gguf` package (GGUFReader) and dequantized with `gguf.quants.dequantize`
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...), stored as float32 safetensors so that float32
and bfloat16 serving both start from the exact dequantized values. The config and tokenizer
(incl. chat template) come from transformers' GGUF integration.

llama.cpp's converter permutes the rows of q/k projections (per head, interleaving the two rotary
halves: GPT-J-style pairs); we undo that to get HF's neox-style "rotate_half" layout.

Cache layout: $PAGELLM_CACHE_DIR (else platformdirs.user_cache_dir("pagellm")) / gguf / <stem>-<key>,
key = hash(file name, size, mtime, CONVERTER_VERSION). Written to a temp dir then renamed (atomic).
The config says bfloat16, so dtype="auto" serves a quantized GGUF in bfloat16.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from pagellm.logger import init_logger

logger = init_logger(__name__)

_SHARD_BYTES = 2 << 30  # flush a safetensors shard at ~2 GiB of float32
_ARCH_TO_HF = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIP = {"rope_freqs.weight"}  # llama3 rope factors: we recompute them from the config's rope parameters


# Part of the cache key: bump it when the converted output changes (2: config dtype bfloat16).
CONVERTER_VERSION = 2


def cache_dir() -> Path:
    env = os.environ.get("PAGELLM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("pagellm"))
    except ImportError:  # pragma: no cover
        return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pagellm"


def gguf_cache_path(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.name}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"


def gguf_name_to_hf(name: str) -> str | None:
    """HF tensor name for a llama GGUF tensor name; None if unknown."""
    base, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_MAP:
        return f"{_GLOBAL_MAP[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_MAP:
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}.{suffix}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows per head go from [d/2, 2] order back to [2, d/2]."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUFReader tensor dequantized to float32 numpy in HF (row-major [out, in]) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        arr = np.asarray(tensor.data, dtype=np.float32)
    else:
        arr = dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (innermost) first
    return arr.reshape(shape)


def _read_field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value


def _write_weights(reader, gguf_path: Path, out: Path, n_head: int, n_kv_head: int) -> None:
    """Dequantize tensor by tensor into float32 safetensors shards of at most ~_SHARD_BYTES each."""
    from safetensors.torch import save_file

    parts: list[list[str]] = []      # tensor names per written part
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        save_file(current, str(out / f".part{len(parts)}.safetensors"), metadata={"format": "pt"})
        parts.append(list(current))
        current, size = {}, 0

    for t in reader.tensors:
        if t.name in _SKIP:
            logger.info("%s: skipping %s (recomputed from rope parameters)", gguf_path.name, t.name)
            continue
        hf_name = gguf_name_to_hf(t.name)
        if hf_name is None:
            raise ValueError(f"{gguf_path}: unexpected tensor {t.name!r} for a llama GGUF")
        try:
            w = dequantize_tensor(t)
        except NotImplementedError as e:
            raise ValueError(f"{gguf_path}: tensor {t.name!r}: unsupported quantization {t.tensor_type.name}") from e
        if ".attn_q." in t.name:
            w = unpermute_qk(w, n_head)
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, n_kv_head)
        w = np.ascontiguousarray(w, dtype=np.float32)
        tensor = torch.from_numpy(w if w.flags.writeable else w.copy())
        if current and size + tensor.nbytes > _SHARD_BYTES:
            flush()
        current[hf_name] = tensor
        size += tensor.nbytes
    if current or not parts:
        flush()
    n = len(parts)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, keys in enumerate(parts):
        os.replace(out / f".part{i}.safetensors", out / names[i])
        weight_map.update({k: names[i] for k in keys})
    if n > 1:
        with open(out / "model.safetensors.index.json", "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh, indent=2)


def _generation_config(reader, tokenizer) -> dict:
    eos = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = _read_field(reader, key)
        if v is not None and int(v) not in eos:
            eos.append(int(v))
    if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = [int(tokenizer.eos_token_id)]
    gen: dict = {"eos_token_id": eos}
    bos = _read_field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    pad = _read_field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    for key, hf_key, cast in (("general.sampling.temp", "temperature", float),
                              ("general.sampling.top_p", "top_p", float),
                              ("general.sampling.top_k", "top_k", int),
                              ("general.sampling.min_p", "min_p", float),
                              ("general.sampling.penalty_repeat", "repetition_penalty", float)):
        v = _read_field(reader, key)
        if v is not None:
            gen[hf_key] = cast(v)
    return gen


def _convert(gguf_path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    arch = _read_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (supported: llama)")
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if config.model_type not in _ARCH_TO_HF:
        raise ValueError(f"{gguf_path}: model_type {config.model_type!r} not supported (supported: {list(_ARCH_TO_HF)})")
    config.architectures = [_ARCH_TO_HF[config.model_type]]
    # The dequantized values are stored exactly, in float32. A quantized GGUF has no float dtype of its
    # own; "auto" loads it in bfloat16 (what Llama-family checkpoints are published in, and twice as fast
    # as float32 on a CPU with AVX512-BF16/AMX); dtype="float32" gives the exact dequantized values.
    config.dtype = torch.bfloat16
    tokenizer = None
    if _read_field(reader, "tokenizer.ggml.model") is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        if tokenizer.chat_template is None:
            tmpl = _read_field(reader, "tokenizer.chat_template")
            if tmpl:
                tokenizer.chat_template = tmpl
        tokenizer.save_pretrained(str(out))
    gen = _generation_config(reader, tokenizer)
    if gen["eos_token_id"]:
        config.eos_token_id = gen["eos_token_id"][0] if len(gen["eos_token_id"]) == 1 else gen["eos_token_id"]
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    _write_weights(reader, gguf_path, out, n_head, n_kv_head)
    config.save_pretrained(str(out))
    with open(out / "generation_config.json", "w") as fh:
        json.dump(gen, fh, indent=2)
    with open(out / "pagellm_source.json", "w") as fh:
        st = gguf_path.stat()
        json.dump({"gguf": str(gguf_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}, fh, indent=2)


def gguf_to_hf_dir(gguf_path: str | os.PathLike) -> Path:
    """The HF-format directory for `gguf_path`, converting it on first use."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: GGUF file not found")
    out = gguf_cache_path(gguf_path)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    logger.info("converting %s -> %s (once)", gguf_path, out)
    try:
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent converter that won
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
