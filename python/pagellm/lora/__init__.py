"""LoRA adapters (issue 19): PEFT adapters loaded at start or run time, batched steps mixing adapters.

    llm = LLM(model, enable_lora=True, max_loras=4, max_lora_rank=16)
    llm.load_lora("sql", "/path/to/peft_dir")
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1))
"""

from pagellm.lora.config import LoRAConfig
from pagellm.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
