"""Building the draft model of the `draft_model` proposer, and the checks that it can draft for the target.

    external draft  options["model"]: an HF directory or a .gguf file (any size, same tokenizer), loaded
                    with pagellm's own loader (`quantization` / `dtype` as for the target)
    self-draft      options["model"] None: the target's first `num_layers` decoder layers + its final norm
                    and LM head. The target's own modules (no copy) when the target runs in this process
                    and the draft keeps its dtype and weight format; else the target's checkpoint loaded
                    again (e.g. quantization="int8" or "gguf": a cheaper copy of every layer).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from pagellm.logger import init_logger

logger = init_logger(__name__)

DRAFT_OPTIONS = ("model", "num_layers", "quantization", "dtype", "num_kv_blocks", "reuse_target_kv")


@dataclass(frozen=True)
class DraftOptions:
    """The `draft_model` method's own speculative_config keys.

    model:         path of the draft (HF directory or .gguf), None = a self-draft made from the target
    num_layers:    keep the first N decoder layers (+ final norm + LM head); None = all
    quantization:  the draft's weight format (a registered method, e.g. "int8", "gguf"); None = the checkpoint's
    dtype:         the draft's dtype ("auto" / None: as the engine's dtype setting resolves for the draft)
    num_kv_blocks: blocks of the draft's KV cache; None = as many as the target's (memory permitting)
    reuse_target_kv: a draft whose KV layout is the target's (a self-draft of every layer) copies the committed
                   tokens' KV from the target instead of recomputing the prompt (draft_kv_reuse.py); default True
    """

    model: str | None = None
    num_layers: int | None = None
    quantization: str | None = None
    dtype: str | None = None
    num_kv_blocks: int | None = None
    reuse_target_kv: bool = True

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "DraftOptions":
        """Type and range checks of the values (ValueError); paths and layer counts are checked against
        the files in `build_draft_model`."""
        model = options.get("model")
        if model is not None and not isinstance(model, (str, Path)):
            raise ValueError(f"speculative_config: model must be a path (str) or None, got {model!r}")
        for key in ("num_layers", "num_kv_blocks"):
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config: {key} must be None or an integer >= 1, got {value!r}")
        for key in ("quantization", "dtype"):
            value = options.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"speculative_config: {key} must be None or a string, got {value!r}")
        reuse = options.get("reuse_target_kv", True)
        if not isinstance(reuse, bool):
            raise ValueError(f"speculative_config: reuse_target_kv must be True or False, got {reuse!r}")
        return cls(None if model is None else str(model), options.get("num_layers"), options.get("quantization"),
                   options.get("dtype"), options.get("num_kv_blocks"), reuse)


def first_layers_view(model: nn.Module, num_layers: int) -> nn.Module:
    """`model` with only its first `num_layers` decoder layers (`model.model.layers`), sharing every
    module and tensor with it: embeddings, those layers, the final norm and the LM head. The model's
    own forward runs the view unchanged (it iterates `self.layers`)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"num_layers: {type(model).__name__} has no model.layers list to take layers from")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be in [1, {len(layers)}] (the model's decoder layers), got {num_layers}")
    inner_view = copy.copy(inner)  # a shallow copy shares the module dict: give it its own
    inner_view.__dict__["_modules"] = dict(inner._modules)
    inner_view.layers = nn.ModuleList(list(layers)[:num_layers])
    view = copy.copy(model)
    view.__dict__["_modules"] = dict(model._modules)
    view.model = inner_view
    return view


def check_same_vocabulary(draft_files, target_vocab_size: int, target_tokenizer, where: str) -> None:
    """ValueError when the draft's vocabulary size or its tokenizer's vocabulary differs from the target's."""
    vocab = int(draft_files.hf_config.vocab_size)
    if vocab != target_vocab_size:
        raise ValueError(f"speculative_config: the draft {where} has vocab_size {vocab}, the target "
                         f"{target_vocab_size}: a draft must share the target's vocabulary")
    draft_tok = draft_files.tokenizer
    if draft_tok is None or target_tokenizer is None:
        logger.warning("draft %s: no tokenizer to compare with the target's; vocab sizes match", where)
        return
    # ids past the model's vocabulary can never be drafted (a converted GGUF's tokenizer may add one)
    def in_model(tok) -> dict[str, int]:
        return {t: i for t, i in tok.get_vocab().items() if i < target_vocab_size}

    if in_model(draft_tok) != in_model(target_tokenizer):
        raise ValueError(f"speculative_config: the draft {where} has a different tokenizer from the target's "
                         "(token ids would not mean the same text)")


def _target_in_process(worker) -> tuple[nn.Module, torch.dtype]:
    return worker.model, worker.dtype


def _shared_target(executor) -> tuple[nn.Module, torch.dtype] | None:
    """The target's model and dtype when its (single) worker lives in this process."""
    if executor is None:
        return None
    try:
        results = executor.collective_rpc(_target_in_process)
    except Exception as e:  # noqa: BLE001 - an out-of-process executor: load the checkpoint again
        logger.info("self-draft: target model not reachable in process (%s); loading its weights again", e)
        return None
    if len(results) != 1 or not isinstance(results[0][0], nn.Module):
        return None
    return results[0]


def _open_draft_files(opts: DraftOptions, context):
    """(ModelFiles, where) of the draft: its own files, or the target's for a self-draft."""
    from pagellm.model_loader import open_model  # noqa: PLC0415

    if opts.model is None:
        return context.model_files, "self-draft"
    path = Path(opts.model).expanduser()
    if not path.exists():
        raise ValueError(f"speculative_config: draft model path {str(path)!r} does not exist "
                         "(an HF-format directory or a .gguf file)")
    return open_model(path), repr(str(path))


def build_draft_model(opts: DraftOptions, context) -> tuple[nn.Module, torch.dtype]:
    """The draft model (eval mode, on the target's device) and its dtype, checked against the target: ValueError for a
    missing path, another vocabulary or tokenizer, num_layers out of range, too short a context, or a
    self-draft that would be the target itself."""
    from pagellm.model_loader import build_model, resolve_dtype  # noqa: PLC0415

    mc = context.engine_config.model_config
    max_model_len = context.engine_config.scheduler_config.max_model_len
    if opts.model is None and opts.num_layers is None and opts.quantization is None and opts.dtype is None:
        raise ValueError("speculative_config: a self-draft (model=None) needs num_layers, quantization or dtype; "
                         "otherwise it is the target model itself")
    files, where = _open_draft_files(opts, context)
    check_same_vocabulary(files, context.vocab_size, context.tokenizer, where)
    total = int(files.hf_config.num_hidden_layers)
    if opts.num_layers is not None and not 1 <= opts.num_layers <= total:
        raise ValueError(f"speculative_config: num_layers must be in [1, {total}] (the {where} model's decoder "
                         f"layers), got {opts.num_layers}")
    max_pos = getattr(files.hf_config, "max_position_embeddings", None)
    if max_pos is not None and max_pos < max_model_len:
        raise ValueError(f"speculative_config: the draft {where} has max_position_embeddings={max_pos} < the "
                         f"engine's max_model_len={max_model_len}")
    auto = mc.torch_dtype(resolve_dtype("auto", files.hf_config))
    dtype = auto if opts.dtype in (None, "auto") else resolve_dtype(opts.dtype)
    shared = _shared_target(context.executor) if opts.model is None and opts.quantization is None else None
    if shared is not None and shared[1] == dtype:
        model = shared[0]
    else:
        # a self-draft loaded again keeps the target's weight format unless it names its own
        quantization = opts.quantization if opts.quantization is not None or opts.model is not None else mc.quantization
        model = build_model(files, dtype, mc.device, quantization=quantization)
    if opts.num_layers is not None:
        model = first_layers_view(model, opts.num_layers)
    return model, dtype
