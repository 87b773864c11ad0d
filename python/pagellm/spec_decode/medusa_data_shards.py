"""Self-distillation data answered in shards (`pagellm train-medusa --data distill --shard-size N`).

Session 19 found the 2400-answer cache learned by the heads (2.05 accepted on their own answers, 1.59 held out):
the lever left is several times more distinct answers, which take an hour or more of engine time. So the training
prompts are one fixed list, `distill_prompts(num_train_seqs, seed)` (shuffled: every slice holds the kinds in their
proportions), cut into shards of `shard_size` prompts. A shard is answered by the engine (its first
round(sampled_fraction x size) prompts sampled, the rest greedy: `distill_training_data`'s recipe) and saved as its
own file at once; the held-out set is one more file. A run answers the shards it is asked for (`answer_shards`) that no
cache directory holds yet, so the answering can go piece by piece, in several processes side by side, and be
resumed; training then reads every shard of the same settings found in any of the cache directories it is given
(a list), laid end to end in shard order.

Files: `<dir>/medusa-shard-<key>-<i>.pt` (the training tuple of shard i: token ids, hidden states, positions, greedy
labels) and `<dir>/medusa-heldout-<key>.pt`; key: a hash of the model and the data settings the answers depend on.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Sequence

import torch

SHARD_KEYS = ("data", "seq_len", "num_train_seqs", "num_heads", "seed", "sampled_fraction", "sample_temperature",
              "shard_size")
HELD_OUT_KEYS = ("data", "seq_len", "num_eval_seqs", "num_heads", "seed")


def num_shards(config) -> int:
    return -(-config.num_train_seqs // config.shard_size)


def parse_shards(spec: str | None, total: int) -> list[int]:
    """'all' | 'none' | '0-4,7' -> sorted shard indices (ValueError outside 0 .. total - 1)."""
    if spec is None or spec == "all":
        return list(range(total))
    if spec == "none":
        return []
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"shards must be 'all', 'none' or like '0-4,7', got {spec!r}") from None
        if not 0 <= first <= last < total:
            raise ValueError(f"shards {part!r} outside 0-{total - 1} ({total} shards)")
        out.update(range(first, last + 1))
    return sorted(out)


def _key(model: str | None, config, keys: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps([str(model), *(getattr(config, k) for k in keys)]).encode()).hexdigest()[:16]


def shard_path(cache: str | Path, model: str | None, config, index: int) -> Path:
    return Path(cache).expanduser() / f"medusa-shard-{_key(model, config, SHARD_KEYS)}-{index:03d}.pt"


def held_out_path(cache: str | Path, model: str | None, config) -> Path:
    return Path(cache).expanduser() / f"medusa-heldout-{_key(model, config, HELD_OUT_KEYS)}.pt"


def _find(caches: Sequence[str | Path], name_of: Callable[[str | Path], Path]) -> Path | None:
    return next((p for p in map(name_of, caches) if p.is_file()), None)


def _save(path: Path, data) -> None:
    """Written under a temporary name first: a process reading the directory never sees half a shard."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    tmp.replace(path)


def answer_shards(caches: Sequence[str | Path], model: str | None, config, shards: Sequence[int],
                  answer: Callable[[list[list[int]], bool], tuple], prompt_ids: Callable[[], list[list[int]]],
                  say: Callable[[str], None]) -> None:
    """Answer each listed shard no cache holds (`answer(prompts, held_out)`: distill_training_data's tuple) and the
    held-out set if none holds it, each saved to caches[0] as soon as it is done. `prompt_ids()`: the whole
    training list's token ids (built once, only if a shard is missing)."""
    if not caches:
        raise ValueError("answering in shards needs a data cache directory (--data-cache)")
    if _find(caches, lambda c: held_out_path(c, model, config)) is None:
        _save(held_out_path(caches[0], model, config), answer(None, True))
    todo = [i for i in shards if _find(caches, lambda c, i=i: shard_path(c, model, config, i)) is None]
    prompts = prompt_ids() if todo else []
    for i in todo:
        part = prompts[i * config.shard_size : (i + 1) * config.shard_size]
        say(f"shard {i} ({len(part)} prompts) of {num_shards(config)}")
        _save(shard_path(caches[0], model, config, i), answer(part, False))


def load_shards(caches: Sequence[str | Path], model: str | None, config,
                say: Callable[[str], None]) -> dict[bool, tuple]:
    """{True: the held-out tuple, False: every shard found in any cache, laid end to end in shard order}: token ids
    [1, S], hidden states [1, S, H] (bf16), flat positions, greedy labels [1, S]. ValueError if the held-out set or
    every shard is missing."""
    held = _find(caches, lambda c: held_out_path(c, model, config))
    found = [p for i in range(num_shards(config))
             if (p := _find(caches, lambda c, i=i: shard_path(c, model, config, i))) is not None]
    if held is None or not found:
        raise ValueError(f"no held-out set or no shard of these settings in {list(map(str, caches))}: answer them "
                         "first (--answer-shards)")
    parts = [torch.load(p) for p in found]
    say(f"training on {len(found)} of {num_shards(config)} shards: " + ", ".join(p.stem.rsplit("-", 1)[1] for p in found))
    return {True: torch.load(held), False: concat_parts(parts)}


def concat_parts(parts: list[tuple]) -> tuple:
    """Training tuples (token ids [1, S_i], hidden [1, S_i, H], flat positions, labels [1, S_i]) laid end to end:
    each part's positions shifted by the tokens before it."""
    offsets = [0]
    for ids, *_ in parts:
        offsets.append(offsets[-1] + ids.shape[1])
    ids = torch.cat([p[0] for p in parts], dim=1)
    hidden = torch.empty(1, offsets[-1], parts[0][1].shape[-1], dtype=parts[0][1].dtype)
    for (_, h, *_), start in zip(parts, offsets):
        hidden[0, start : start + h.shape[1]] = h[0]
    positions = torch.cat([p[2] + start for p, start in zip(parts, offsets)])
    labels = torch.cat([p[3] for p in parts], dim=1)
    return ids, hidden, positions, labels
