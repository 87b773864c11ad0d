"""How a Linear gets its LoRA term: a forward hook installed by the LoRAModelManager.

A hook rather than a wrapper module keeps every parameter's name (weight loading and in-place weight
updates address parameters by name) and works over any LinearMethod (quantized ones too): the term is added
to whatever the layer's method returned. Outside a LoRA step the hook returns at once and records nothing,
so step graphs captured for plain decode steps stay free of LoRA ops (LoRA steps run eagerly, model_runner).

Per wrapped layer, `LoRASlotBuffers` holds every slot's adapter stacked for `lora_apply`: a merged layer's
shards (q/k/v, gate/up) sit side by side in the rank dimension, lora_a [S, num_shards * r_max, K] and
lora_b [S, N, num_shards * r_max] block-diagonal, so one op call serves the whole merged layer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pagellm.layers.linear import Linear, MergedLinear

try:
    import pagellm.ops  # noqa: F401  (registers torch.ops.pagellm.lora_apply)

    _lora_apply = torch.ops.pagellm.lora_apply if hasattr(torch.ops.pagellm, "lora_apply") else None
except ImportError:  # pragma: no cover - a build without the extension
    _lora_apply = None
if _lora_apply is None:  # pragma: no cover
    from pagellm.ops.lora_reference import lora_apply as _lora_apply


class LoRAStepState:
    """The running step's token -> slot map (int32 [num_tokens], -1 = no adapter); None outside LoRA steps.
    One per manager, shared by its hooks, set by the model runner around a forward."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None

    @contextlib.contextmanager
    def step(self, token_slots: torch.Tensor | None) -> Iterator[None]:
        self.token_slots = token_slots
        try:
            yield
        finally:
            self.token_slots = None


class LoRASlotBuffers:
    """Every slot's LoRA weights of one Linear, padded to `max_rank` per shard, plus the hook that applies them."""

    def __init__(self, module: Linear, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if isinstance(module, MergedLinear):
            self.shard_rows = dict(module.shard_offsets)  # shard id -> (first output row, rows)
        else:
            self.shard_rows = {None: (0, module.out_features)}
        self.max_rank = max_rank
        rank_dim = len(self.shard_rows) * max_rank
        self.lora_a = torch.zeros(num_slots, rank_dim, module.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, module.out_features, rank_dim, dtype=dtype, device=device)

    def write_slot(self, slot: int, shards: dict[object, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Slot `slot` := these shards' (A [r, K], B [rows, r]); absent shards (and None) are zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, (shard_id, (row0, rows)) in enumerate(self.shard_rows.items()):
            if shards is None or shard_id not in shards:
                continue
            a, b = shards[shard_id]
            r, col0 = a.shape[0], i * self.max_rank
            self.lora_a[slot, col0 : col0 + r].copy_(a)
            self.lora_b[slot, row0 : row0 + rows, col0 : col0 + r].copy_(b)

    def make_hook(self, state: LoRAStepState, scales: torch.Tensor):
        """forward hook adding the LoRA term of the step's slots to the layer's output [..., N]."""

        def hook(module, args, output):
            slots = state.token_slots
            if slots is None:
                return None
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            y2 = output.view(-1, output.shape[-1])
            _lora_apply(y2, x2, self.lora_a, self.lora_b, scales, slots)
            return output

        return hook
