"""LoRAConfig: the engine's LoRA limits (vLLM's names), validated once."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_LORA_RANKS_MAX = 512


@dataclass(frozen=True)
class LoRAConfig:
    """`max_loras`: adapters one step may use (= the model's adapter slots); `max_lora_rank`: the largest
    adapter rank accepted (slots are padded to it); `max_cpu_loras`: adapters kept loaded in host memory
    (None = max_loras; loading one more than that refuses until one is removed)."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name, value, low, high in (("max_loras", self.max_loras, 1, 1024),
                                       ("max_lora_rank", self.max_lora_rank, 1, SUPPORTED_LORA_RANKS_MAX)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        cpu = self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}) or None, got {cpu!r}")
