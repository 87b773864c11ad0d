"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head k guessing the
token k + 1 places after the one the target's own LM head predicts.

    head k (k = 0 .. K-1):  h -> ResBlock^num_layers -> LM head -> logits of token t + k + 2
    ResBlock(x) = x + SiLU(W x + b)       (W zero-initialised: an untrained head is the identity)

`h` is the final normed hidden state at position t (what `ModelRunner.execute(hidden_state_rows=)` returns);
the target's LM head on h gives token t + 1.

LM heads. `share_lm_head=True` (the default, chosen for CPU): every head reuses the target's LM head, only
the ResBlocks (K * num_layers * (H*H + H) parameters) are trained and stored; drafting K tokens costs one
[B*K, H] x [H, V] product with weights already in cache. `share_lm_head=False` is Medusa's reference
layout: each head owns a [V, H] LM head (initialised from the target's, `init_lm_heads_from`), K times the
LM head's memory and time.

Draft vocabulary (optional, shared LM head only; FR-Spec, Zhao et al. 2025): `draft_vocab`, the ids of the S
tokens the model emits most often (counted by the trainer on the model's own answers). The proposer then
scores only those rows of the LM head, an [S, H] product instead of [V, H] (SmolLM2: 49152 -> 8192 rows,
a sixth of the bytes); a token outside it is never drafted, which costs acceptance, never correctness.

On disk (a directory):
    medusa_lm_head.safetensors   medusa_head.{i}.{j}.linear.weight [H, H], medusa_head.{i}.{j}.linear.bias [H]
                                 for head i < K, block j < num_layers; with own LM heads also
                                 medusa_head.{i}.{num_layers}.weight [V, H]   (Medusa's reference names)
    medusa_config.json           {"medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size",
                                  "share_lm_head", "base_model_name_or_path", "base_model_hash", "training",
                                  "draft_vocab_size", "head_type": "medusa"}
                                 with a draft vocabulary also `draft_vocab` int64 [S] in the safetensors file
Heads that see the drafted tokens (`"head_type": "hydra"`, hydra_heads.py) share this layout and interface
(`teacher_forced`, `draft_chain`, `draft_tree`); `hydra_heads.load_draft_heads` loads either kind.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F


WEIGHTS_NAME = "medusa_lm_head.safetensors"
CONFIG_NAME = "medusa_config.json"
DRAFT_VOCAB_NAME = "draft_vocab"


class ResBlock(nn.Module):
    """x + SiLU(W x + b): [..., H] -> [..., H]. W starts at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads over the target's final normed hidden states (module layout: `medusa_head[i]` is an
    nn.Sequential of num_layers ResBlocks, then, without share_lm_head, the head's own Linear(H, V))."""

    head_type = "medusa"  # medusa_config.json's "head_type" (absent in older files: medusa)

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 3, num_layers: int = 1,
                 share_lm_head: bool = True, base_model: str | None = None, base_model_hash: str | None = None) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size), ("num_heads", num_heads),
                            ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaHeads: {name} must be an integer >= 1, got {value!r}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.share_lm_head = bool(share_lm_head)
        self.base_model, self.base_model_hash = base_model, base_model_hash
        self.training_info: dict[str, Any] = {}
        self.draft_vocab: torch.Tensor | None = None  # set_draft_vocab
        self._build_heads()

    def _build_heads(self) -> None:
        heads = []
        for _ in range(self.num_heads):
            blocks: list[nn.Module] = [ResBlock(self.hidden_size) for _ in range(self.num_layers)]
            if not self.share_lm_head:
                blocks.append(nn.Linear(self.hidden_size, self.vocab_size, bias=False))
            heads.append(nn.Sequential(*blocks))
        self.medusa_head = nn.ModuleList(heads)

    # ------------------------------------------------------------------ compute
    def head_states(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[N, H] final hidden states -> [N, k, H] the ResBlock outputs of the first k heads (k = num_heads or K)."""
        k = self._count(num_heads)
        outs = []
        for head in list(self.medusa_head)[:k]:
            x = hidden
            for block in list(head)[: self.num_layers]:
                x = block(x)
            outs.append(x)
        return torch.stack(outs, dim=-2)

    def forward(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                num_heads: int | None = None) -> torch.Tensor:
        """[N, H] -> [N, k, V] logits of the first k heads. `lm_head` ([M, H] -> [M, V], the target's LM
        head) is required with share_lm_head and ignored without."""
        states = self.head_states(hidden, num_heads)
        n, k, h = states.shape
        if self.share_lm_head:
            if lm_head is None:
                raise ValueError("MedusaHeads with share_lm_head=True need the target's lm_head callable")
            return lm_head(states.reshape(n * k, h)).reshape(n, k, -1)
        return torch.stack([head[self.num_layers](states[:, i]) for i, head in enumerate(list(self.medusa_head)[:k])],
                           dim=1)

    def teacher_forced(self, hidden: torch.Tensor, input_ids: torch.Tensor | None,
                       lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                       num_heads: int | None = None) -> torch.Tensor:
        """[N, H] -> [N, k, V] training logits. `input_ids` [N, k] (the tokens before each head's guess, which
        Hydra heads read) is ignored: a Medusa head sees only h."""
        return self(hidden, lm_head, num_heads)

    @torch.no_grad()
    def draft_chain(self, hidden: torch.Tensor, last_ids: torch.Tensor | None,
                    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None, num_heads: int | None = None,
                    to_token_ids: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """[B, H] -> [B, k] top-1 draft token ids of the first k heads (`last_ids` [B], the token h gave, is
        ignored). `to_token_ids`: the LM head's indices -> token ids (a draft vocabulary; None: the same)."""
        top = self(hidden, lm_head, num_heads).argmax(dim=-1)
        return top if to_token_ids is None else to_token_ids(top)

    @torch.no_grad()
    def draft_tree(self, hidden: torch.Tensor, last_ids: torch.Tensor | None, parents: Sequence[int],
                   ranks: Sequence[int], lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   to_token_ids: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """A candidate tree's tokens [B, num_nodes]: node j (parents[j]: its parent, -1 the root; parents
        first) is head depth(j)'s ranks[j]-th most likely token, whatever its parent (Medusa's trees)."""
        depths: list[int] = []
        for p in parents:
            depths.append(0 if p < 0 else depths[p] + 1)
        logits = self(hidden, lm_head, num_heads=max(depths) + 1)  # [B, depth, V]
        topk = logits.topk(max(ranks) + 1, dim=-1).indices
        topk = topk if to_token_ids is None else to_token_ids(topk)
        return topk[:, torch.tensor(depths), torch.tensor(list(ranks))]

    def _count(self, num_heads: int | None) -> int:
        if num_heads is None:
            return self.num_heads
        if not 1 <= num_heads <= self.num_heads:
            raise ValueError(f"num_heads must be in [1, {self.num_heads}], got {num_heads}")
        return num_heads

    # ------------------------------------------------------------------ checks and initialisation
    def check_target(self, hidden_size: int, vocab_size: int) -> None:
        """ValueError when the heads were made for another hidden size or vocabulary."""
        if self.hidden_size != hidden_size:
            raise ValueError(f"Medusa heads have hidden_size {self.hidden_size}, the target model {hidden_size}")
        if self.vocab_size != vocab_size:
            raise ValueError(f"Medusa heads have vocab_size {self.vocab_size}, the target model {vocab_size}")

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's LM head [V, H] into every head's own LM head (Medusa's initialisation)."""
        if self.share_lm_head:
            raise ValueError("init_lm_heads_from: these heads share the target's LM head (share_lm_head=True)")
        if tuple(lm_head_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"lm_head_weight must be [{self.vocab_size}, {self.hidden_size}], "
                             f"got {list(lm_head_weight.shape)}")
        for head in self.medusa_head:
            head[self.num_layers].weight.copy_(lm_head_weight)

    def set_draft_vocab(self, token_ids: torch.Tensor | None) -> None:
        """Restrict drafting to these token ids (unique, in [0, vocab_size); None: the whole vocabulary)."""
        if token_ids is None:
            self.draft_vocab = None
            return
        if not self.share_lm_head:
            raise ValueError("a draft vocabulary needs heads that share the target's LM head")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"draft vocabulary: ids must be in [0, {self.vocab_size}) and not empty")
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary: ids must be unique")
        self.draft_vocab = ids.sort().values

    # ------------------------------------------------------------------ files
    def config_dict(self) -> dict[str, Any]:
        return {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "share_lm_head": self.share_lm_head,
                "base_model_name_or_path": self.base_model, "base_model_hash": self.base_model_hash,
                "training": self.training_info,
                "draft_vocab_size": 0 if self.draft_vocab is None else int(self.draft_vocab.numel()),
                "head_type": self.head_type}

    def save(self, directory: str | Path) -> Path:
        """Write medusa_lm_head.safetensors (fp32 unless the heads are in another dtype) and medusa_config.json."""
        from safetensors.torch import save_file  # noqa: PLC0415

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.draft_vocab is not None:
            tensors[DRAFT_VOCAB_NAME] = self.draft_vocab.contiguous()
        save_file(tensors, str(out / WEIGHTS_NAME))
        (out / CONFIG_NAME).write_text(json.dumps(self.config_dict(), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype | None = None) -> "MedusaHeads":
        """Heads saved by `save` (or Medusa's reference layout: sizes are read off the tensors when the
        config lacks them). ValueError for a missing file or tensors that do not match the config."""
        from safetensors.torch import load_file  # noqa: PLC0415

        path = Path(directory).expanduser()
        if not (path / WEIGHTS_NAME).is_file():
            raise ValueError(f"Medusa heads: {str(path / WEIGHTS_NAME)!r} not found (save with MedusaHeads.save "
                             "or `pagellm train-medusa`)")
        config = json.loads((path / CONFIG_NAME).read_text()) if (path / CONFIG_NAME).is_file() else {}
        if config.get("head_type", "medusa") != cls.head_type:
            raise ValueError(f"{str(path)!r} holds {config.get('head_type')!r} heads, not {cls.head_type!r} "
                             "(hydra_heads.load_draft_heads loads either kind)")
        tensors = load_file(str(path / WEIGHTS_NAME))
        draft_vocab = tensors.pop(DRAFT_VOCAB_NAME, None)
        heads = cls(**_constructor_args(config, tensors, f"{cls.head_type}_head"))
        heads.training_info = dict(config.get("training") or {})
        missing, unexpected = heads.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"Medusa heads in {str(path)!r}: missing tensors {missing}, unexpected {unexpected}")
        heads.set_draft_vocab(draft_vocab)
        return heads.to(dtype) if dtype is not None else heads


def _constructor_args(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                      prefix: str = "medusa_head") -> dict[str, Any]:
    """MedusaHeads(...) arguments from a config dict, completed from the tensors' names and shapes
    (`prefix`: the heads' module name, medusa_head or hydra_head)."""
    head_ids = {int(name.split(".")[1]) for name in tensors if name.startswith(prefix + ".")}
    if not head_ids:
        raise ValueError(f"Medusa heads: the weights file holds no {prefix}.* tensors")
    blocks = {int(name.split(".")[2]) for name in tensors if name.startswith(f"{prefix}.0.") and ".linear." in name}
    num_layers = int(config.get("medusa_num_layers", len(blocks)))
    hidden = int(config.get("hidden_size", tensors[f"{prefix}.0.0.linear.weight"].shape[0]))
    own_lm = f"{prefix}.0.{num_layers}.weight"
    share = bool(config.get("share_lm_head", own_lm not in tensors))
    vocab = config.get("vocab_size")
    if vocab is None:
        if own_lm not in tensors:
            raise ValueError("Medusa heads: medusa_config.json lacks vocab_size and the heads have no own LM head")
        vocab = tensors[own_lm].shape[0]
    return {"hidden_size": hidden, "vocab_size": int(vocab), "num_heads": int(config.get("medusa_num_heads",
            len(head_ids))), "num_layers": num_layers, "share_lm_head": share,
            "base_model": config.get("base_model_name_or_path"), "base_model_hash": config.get("base_model_hash")}


def draft_vocab_lm_head(weight: torch.Tensor, draft_vocab: torch.Tensor) -> "DraftVocabLMHead":
    """[M, H] -> [M, S] fp32: the LM head's rows of the draft vocabulary only (DraftVocabLMHead)."""
    return DraftVocabLMHead(weight[draft_vocab])


class DraftVocabLMHead:
    """A draft vocabulary's LM-head rows [S, H], scored as int8 rows (one fp32 scale per row) against int8 inputs
    (LLM.int8()'s absmax rows, no outlier columns: `int8_linear`), fp32 logits out. Drafts need the order of the top
    few logits, not their last bits: on the held-out distilled answers the chain's mean accepted length is 1.4843
    against bf16 rows' 1.4848 (session 16), at half the bytes: 0.21 against 0.42 ms per [1, 576] x [8192, 576] call on
    the 2-core EPYC (one thread), the largest part of a Hydra chain's drafting. The trainer's served evaluation scores
    through the same object (medusa_train.served_lm_head), so held-out figures are the served ones."""

    def __init__(self, rows: torch.Tensor) -> None:
        from pagellm.quantization.int8 import default_int8_op, quantize_weight_rows  # noqa: PLC0415

        self.qweight, self.scale = quantize_weight_rows(rows.detach().float())
        self._op = default_int8_op(self.qweight.device)

    @property
    def num_rows(self) -> int:
        return int(self.qweight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] any float dtype -> [..., S] fp32."""
        lead = x.shape[:-1]
        x2 = x.float().reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty((x2.shape[0], self.num_rows), dtype=torch.float32, device=x.device)
        self._op(out, x2, self.qweight, self.scale, None, 0.0, False, 0)
        return out.reshape(*lead, self.num_rows)


def base_model_hash(hf_config) -> str:
    """A short fingerprint of a base model's architecture (sizes, vocabulary, rope): heads trained on
    one model warn when loaded for another."""
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "rope_theta", "tie_word_embeddings")
    desc = json.dumps({k: getattr(hf_config, k, None) for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]
