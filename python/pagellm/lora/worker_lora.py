"""The Worker's LoRA methods (reached through collective_rpc); mixed into engine.worker.Worker."""

from __future__ import annotations

from typing import Any


class WorkerLoRAMixin:
    """Needs `self.lora_manager` (a LoRAModelManager, or None when LoRA is off)."""

    lora_manager = None

    def _lora(self):
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled (EngineArgs(enable_lora=True))")
        return self.lora_manager

    def add_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load or replace adapter `name` from a PEFT directory (checked first; on ValueError nothing changed)."""
        return self._lora().add_adapter(name, path)

    def remove_lora(self, name: str) -> None:
        self._lora().remove_adapter(name)

    def set_lora_slot(self, slot: int, name: str) -> None:
        self._lora().set_slot(slot, name)

    def list_loras(self) -> list[str]:
        return sorted(self._lora().adapters)
