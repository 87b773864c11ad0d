"""Start-up checks for tensor parallelism: every unsupported set-up is refused here, in the driver, before
any worker process starts (so within a bounded time, with a message naming the problem)."""

from __future__ import annotations

from pagellm.distributed.sharding import divide

# HF architectures whose model code passes tp_mode to its linears and tp-local head counts to attention
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def check_tensor_parallel(tp_size: int, hf_config, *, device: str = "cpu", quantization: str | None = None,
                          lora_enabled: bool = False, allowed_cpus: int | None = None) -> None:
    """ValueError when `tp_size` ranks cannot run this model here. `allowed_cpus`: CPUs this process may use
    (each CPU rank needs at least one)."""
    if tp_size == 1:
        return
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs or archs[0] not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={tp_size}: architecture {archs[0] if archs else None!r} has no "
                         f"tensor-parallel support yet; supported: {list(TENSOR_PARALLEL_ARCHITECTURES)}")
    if not device.startswith("cpu"):
        raise ValueError(f"tensor_parallel_size={tp_size}: only device='cpu' (gloo) is supported for now, got {device!r}")
    if allowed_cpus is not None and tp_size > allowed_cpus:
        raise ValueError(f"tensor_parallel_size ({tp_size}) is more than the {allowed_cpus} CPUs this process may "
                         f"use: each rank needs at least one")
    if quantization is not None or getattr(hf_config, "quantization_config", None):
        raise ValueError(f"tensor_parallel_size={tp_size}: tensor parallelism supports unquantized weights only for now")
    if lora_enabled:
        raise ValueError(f"tensor_parallel_size={tp_size}: LoRA adapters are not supported with tensor parallelism yet")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    divide(heads, tp_size, "num_attention_heads")
    if kv_heads >= tp_size:
        divide(kv_heads, tp_size, "num_key_value_heads")
    elif tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads ({kv_heads}) "
                         f"when it is larger")
    divide(hf_config.intermediate_size, tp_size, "intermediate_size")


def cpu_slices(allowed: list[int], tp_size: int) -> list[list[int]]:
    """The allowed CPUs cut into `tp_size` contiguous, near-equal slices (rank r pins to slice r)."""
    if tp_size > len(allowed):
        raise ValueError(f"tensor_parallel_size ({tp_size}) is more than the {len(allowed)} allowed CPUs")
    base, extra = divmod(len(allowed), tp_size)
    out, start = [], 0
    for r in range(tp_size):
        n = base + (1 if r < extra else 0)
        out.append(sorted(allowed)[start:start + n])
        start += n
    return out


def check_pipeline_parallel(pp_size: int, tp_size: int, hf_config, *, device: str = "cpu",
                            quantization: str | None = None, lora_enabled: bool = False, speculative: bool = False,
                            allowed_cpus: int | None = None) -> None:
    """ValueError when `pp_size` stages of `tp_size` ranks each cannot run this model here: more stages than
    decoder layers, more ranks in all than allowed CPUs, or a feature the stages do not pass on yet."""
    if pp_size == 1:
        return
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs or archs[0] not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"pipeline_parallel_size={pp_size}: architecture {archs[0] if archs else None!r} has no "
                         f"pipeline-parallel support yet; supported: {list(TENSOR_PARALLEL_ARCHITECTURES)}")
    num_layers = hf_config.num_hidden_layers
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is more than the model's {num_layers} decoder layers "
                         f"(num_hidden_layers): every stage needs at least one")
    if not device.startswith("cpu"):
        raise ValueError(f"pipeline_parallel_size={pp_size}: only device='cpu' (gloo) is supported for now, "
                         f"got {device!r}")
    world = tp_size * pp_size
    if allowed_cpus is not None and world > allowed_cpus:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({tp_size} x {pp_size} = {world} ranks) is "
                         f"more than the {allowed_cpus} CPUs this process may use: each rank needs at least one")
    if quantization is not None or getattr(hf_config, "quantization_config", None):
        raise ValueError(f"pipeline_parallel_size={pp_size}: pipeline parallelism supports unquantized weights only "
                         f"for now")
    if lora_enabled:
        raise ValueError(f"pipeline_parallel_size={pp_size}: LoRA adapters are not supported with pipeline "
                         f"parallelism yet")
    if speculative:
        raise ValueError(f"pipeline_parallel_size={pp_size}: speculative decoding is not supported with pipeline "
                         f"parallelism yet (its proposers read hidden states of the last stage in the driver)")


def check_speculative_tensor_parallel(tp_size: int, speculative_config) -> None:
    """ValueError when `speculative_config` (a SpeculativeConfig or None) needs the target model in the driver
    and `tp_size` > 1 puts it in other processes: Medusa heads and a self-draft (draft_model without
    `model`). An n-gram proposer or a separate draft checkpoint are fine."""
    # Both run on the target's own modules / LM head, which tensor parallelism shards across the ranks: the
    # driver would silently load a second whole copy of the weights (self-draft) or the LM head from the
    # checkpoint (Medusa), a slow fallback that defeats the point of sharding.
    if tp_size == 1 or speculative_config is None:
        return
    method = speculative_config.method
    if method == "medusa" or (method == "draft_model" and speculative_config.options.get("model") is None):
        what = "Medusa" if method == "medusa" else "a self-draft (draft_model without 'model')"
        raise ValueError(f"speculative_config: {what} is not supported with tensor_parallel_size={tp_size}: it "
                         "runs on the target model, which tensor parallelism shards across the rank processes. "
                         "Use tensor_parallel_size=1, method='ngram', or draft_model with a separate "
                         "'model' checkpoint")
