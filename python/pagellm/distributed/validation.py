"""Start-up checks for tensor parallelism: every unsupported set-up is refused here, in the driver, before
any worker process starts (so within a bounded time, with a message naming the problem)."""

from __future__ import annotations

from pagellm.distributed.sharding import divide

# HF architectures whose model code passes tp_mode to its linears and tp-local head counts to attention
# (MoE ones shard their experts' intermediate dimension, distributed.expert_sharding), and whose model
# builds only its pipeline stage's layers
TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                 "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "DeepseekV2ForCausalLM",
                                 "DeepseekV3ForCausalLM")


def _check_architecture(setting: str, kind: str, hf_config) -> None:
    """ValueError unless the model's architecture can be split (`setting`: "tensor_parallel_size=2",
    `kind`: "tensor-parallel")."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else None
    if arch not in TENSOR_PARALLEL_ARCHITECTURES:
        raise ValueError(f"{setting}: architecture {arch!r} has no {kind} support yet; supported: "
                         f"{list(TENSOR_PARALLEL_ARCHITECTURES)}")


def mlp_width_fields(hf_config) -> list[str]:
    """The config fields holding the widths a tensor-parallel MLP splits: the dense MLPs' intermediate_size,
    the experts' (moe_)intermediate_size and a shared expert's, for the layers the model has."""
    arch = (list(getattr(hf_config, "architectures", None) or []) or [None])[0]
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        from pagellm.models.qwen2_moe import is_sparse_layer  # noqa: PLC0415  (models import this package)

        sparse = [is_sparse_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        fields = ["moe_intermediate_size"] if any(sparse) else []
        if any(sparse) and (getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) > 0:
            fields.append("shared_expert_intermediate_size")
        return fields + (["intermediate_size"] if not all(sparse) else [])
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):  # shared experts: n x moe_intermediate_size
        from pagellm.models.deepseek_v2 import is_moe_layer  # noqa: PLC0415

        moe = [is_moe_layer(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        return (["moe_intermediate_size"] if any(moe) else []) + (["intermediate_size"] if not all(moe) else [])
    return ["intermediate_size"]


def check_tensor_parallel(tp_size: int, hf_config, *, device: str = "cpu", allowed_cpus: int | None = None) -> None:
    """ValueError when `tp_size` ranks cannot run this model here. `allowed_cpus`: CPUs this process may use
    (each CPU rank needs at least one)."""
    if tp_size == 1:
        return
    _check_architecture(f"tensor_parallel_size={tp_size}", "tensor-parallel", hf_config)
    if not device.startswith("cpu"):
        raise ValueError(f"tensor_parallel_size={tp_size}: only device='cpu' (gloo) is supported for now, got {device!r}")
    if allowed_cpus is not None and tp_size > allowed_cpus:
        raise ValueError(f"tensor_parallel_size ({tp_size}) is more than the {allowed_cpus} CPUs this process may "
                         f"use: each rank needs at least one")
    # quantized weights and LoRA adapters are split like float ones (parallel_linear); a shard that cuts an
    # AWQ group, a GGUF block or a packed int32 is refused by the layer that owns it when the rank builds the
    # model, before any weight is read
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    divide(heads, tp_size, "num_attention_heads")
    if kv_heads >= tp_size:
        divide(kv_heads, tp_size, "num_key_value_heads")
    elif tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads ({kv_heads}) "
                         f"when it is larger")
    for field in mlp_width_fields(hf_config):
        divide(getattr(hf_config, field), tp_size, field)


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


def check_pipeline_parallel(pp_size: int, tp_size: int, hf_config, *, device: str = "cpu", speculative_config=None,
                            allowed_cpus: int | None = None) -> None:
    """ValueError when `pp_size` stages of `tp_size` ranks each cannot run this model here: more stages than
    decoder layers, more ranks in all than allowed CPUs, or a speculative method that needs the whole target
    model in the driver (`check_speculative_parallel`)."""
    if pp_size == 1:
        return
    _check_architecture(f"pipeline_parallel_size={pp_size}", "pipeline-parallel", hf_config)
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
    check_speculative_parallel(tp_size, speculative_config, pp_size)


def check_speculative_parallel(tp_size: int, speculative_config, pp_size: int = 1) -> None:
    """ValueError when `speculative_config` (a SpeculativeConfig or None) needs the target model in the driver
    and tp_size > 1 or pp_size > 1 puts it in other processes: Medusa heads and a self-draft (draft_model
    without `model`). An n-gram proposer or a separate draft checkpoint run in the driver and are fine
    (with pipeline stages too: they need only the committed tokens, never a stage's hidden states)."""
    # Both run on the target's own modules / LM head, which tensor parallelism shards across the ranks and
    # pipeline parallelism splits across the stages: the driver would silently load a second whole copy of
    # the weights (self-draft) or the LM head from the checkpoint (Medusa), a slow fallback that defeats the
    # point of splitting. Medusa's tree verification would also move KV slots between steps, which drains
    # the micro-batches in flight.
    if (tp_size == 1 and pp_size == 1) or speculative_config is None:
        return
    method = speculative_config.method
    if method == "medusa" or (method == "draft_model" and speculative_config.options.get("model") is None):
        what = "Medusa" if method == "medusa" else "a self-draft (draft_model without 'model')"
        split = "tensor parallelism shards" if tp_size > 1 else "pipeline parallelism splits"
        setting = f"tensor_parallel_size={tp_size}" if tp_size > 1 else f"pipeline_parallel_size={pp_size}"
        raise ValueError(f"speculative_config: {what} is not supported with {setting}: it runs on the target "
                         f"model, which {split} across the rank processes. Supported there: method='ngram', or "
                         "draft_model with a separate 'model' checkpoint (both run in the driver)")


def check_speculative_tensor_parallel(tp_size: int, speculative_config) -> None:
    """`check_speculative_parallel` with one pipeline stage (the name the config and tests know)."""
    check_speculative_parallel(tp_size, speculative_config)
