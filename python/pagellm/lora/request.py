"""LoRARequest: which adapter a request runs with (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name` names the adapter (the server's `model` field); `lora_int_id` (>= 1) is its numeric id;
    `lora_path` is a PEFT directory (adapter_config.json + adapter_model.safetensors), loaded on first use
    when no adapter of that name is loaded yet."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise TypeError(f"lora_path must be a str, got {type(self.lora_path).__name__}")


def lora_requests_per_prompt(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """`lora_request` (None, one LoRARequest, or a list with one entry per prompt) as one entry per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (str, bytes)) or not hasattr(lora_request, "__len__"):
        raise TypeError(f"lora_request must be a LoRARequest, a list of them, or None, got {type(lora_request).__name__}")
    items = list(lora_request)
    if len(items) != num_prompts:
        raise ValueError(f"got {len(items)} lora_requests for {num_prompts} prompts")
    for lr in items:
        if lr is not None and not isinstance(lr, LoRARequest):
            raise TypeError(f"lora_request entries must be LoRARequest or None, got {type(lr).__name__}")
    return items
