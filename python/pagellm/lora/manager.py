"""LoRAModelManager: a worker's loaded adapters and the model's `max_loras` adapter slots.

Adapters are read and checked in full (peft_loader) before anything changes, so a bad adapter leaves the
loaded ones, the slots and the base weights as they were. Loading an adapter under a name already loaded
replaces it; if it occupies a slot, the slot is rewritten in place (same tensors: nothing captured goes stale).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.lora.config import LoRAConfig
from pagellm.lora.layers import LoRASlotBuffers, LoRAStepState
from pagellm.lora.peft_loader import PEFTAdapter, hf_linear_targets, load_peft_adapter


class LoRAModelManager:
    """Installs LoRA hooks on every Linear of `model` and manages what the slots hold.

    `step_state.token_slots` (int32 [num_tokens]) selects each token's slot during a forward."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.step_state = LoRAStepState()
        self.scales = torch.zeros(config.max_loras, dtype=torch.float32, device=device)
        self.adapters: dict[str, PEFTAdapter] = {}
        self.slot_names: list[str | None] = [None] * config.max_loras
        self.buffers: dict[str, LoRASlotBuffers] = {}
        self._hook_handles = []
        modules = dict(model.named_modules())
        for module_name in sorted({t.module_name for t in hf_linear_targets(model).values()}):
            module = modules[module_name]
            buf = LoRASlotBuffers(module, config.max_loras, config.max_lora_rank, dtype, device)
            self.buffers[module_name] = buf
            hook = buf.make_hook(self.step_state, self.scales)
            if module.tp_plan is not None and module.tp_plan.mode == "row":
                # a row-parallel layer's output is already summed over the ranks: the term over this rank's
                # input columns is added to the partial product instead, and reduced with it
                module.partial_output_hook = _partial_output_hook(hook)
            else:
                self._hook_handles.append(module.register_forward_hook(hook))

    def add_adapter(self, name: str, path: str) -> dict[str, Any]:
        """Load (or replace) adapter `name` from PEFT directory `path`; returns its rank and scale.
        ValueError (nothing changed) for a bad adapter or one more than max_cpu_loras."""
        if name not in self.adapters and len(self.adapters) >= self.config.max_cpu_loras:
            raise ValueError(f"cannot load LoRA adapter {name!r}: max_cpu_loras={self.config.max_cpu_loras} adapters "
                             f"are loaded ({sorted(self.adapters)}); remove one first")
        adapter = load_peft_adapter(path, self.model, self.config.max_lora_rank, self.dtype)
        self.adapters[name] = adapter
        for slot, slot_name in enumerate(self.slot_names):
            if slot_name == name:
                self._write_slot(slot, adapter)
        return {"rank": adapter.rank, "scale": adapter.scale, "path": adapter.path}

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")
        for slot, slot_name in enumerate(self.slot_names):
            if slot_name == name:
                self._write_slot(slot, None)
                self.slot_names[slot] = None
        del self.adapters[name]

    def set_slot(self, slot: int, name: str) -> None:
        """Put loaded adapter `name` into slot `slot` (whatever it held before is dropped from the slot)."""
        if not 0 <= slot < self.config.max_loras:
            raise ValueError(f"slot must be in [0, {self.config.max_loras}), got {slot}")
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}")
        if self.slot_names[slot] != name:
            self._write_slot(slot, self.adapters[name])
            self.slot_names[slot] = name

    def _write_slot(self, slot: int, adapter: PEFTAdapter | None) -> None:
        for module_name, buf in self.buffers.items():
            buf.write_slot(slot, None if adapter is None else adapter.weights.get(module_name))
        self.scales[slot] = 0.0 if adapter is None else adapter.scale


def _partial_output_hook(forward_hook):
    """A forward hook (which adds its term to the output in place) as a row-parallel layer's partial_output_hook."""
    def hook(layer, x, y):
        forward_hook(layer, (x,), y)
        return y

    return hook
