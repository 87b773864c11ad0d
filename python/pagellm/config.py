"""Engine configuration: frozen, validated dataclasses, built from LLM(...) keyword arguments.

    ModelConfig      what to load and how (model, tokenizer, dtype, quantization, device, max_model_len, seed)
    CacheConfig      the paged KV cache (block size, memory budget, prefix caching)
    SchedulerConfig  batching limits (max_num_seqs, max_num_batched_tokens, chunked prefill)
    EngineConfig     the three together (+ parallel, and an optional SpeculativeConfig)

Invalid values raise ValueError naming the field and its allowed range. `cpp_kwargs()` gives the
keyword arguments of pagellm._C.Scheduler (its C++ configs) for the C++ scheduler.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from pagellm.lora.config import LoRAConfig
from pagellm.sampling_params import LOGPROBS_MODES
from pagellm.spec_decode.registry import SpeculativeConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")
_POLICIES = ("fcfs", "priority")


def kv_cache_dtypes() -> tuple[str, ...]:
    """Allowed `kv_cache_dtype` values (vLLM's names): "auto" (the model dtype), "int8", and "fp8_e4m3"
    when this torch has float8_e4m3fn. Quantized caches store one float32 scale per (token, kv head)."""
    import torch  # noqa: PLC0415 (config stays importable without touching torch at import time)

    return ("auto", "int8") + (("fp8_e4m3",) if hasattr(torch, "float8_e4m3fn") else ())


def _require(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # path / HF-style name; None = the default model
    tokenizer: str | None = None  # defaults to the model's tokenizer
    dtype: str = "auto"
    max_model_len: int | None = None  # None = the model's maximum
    seed: int = 0
    device: str = "cpu"
    attention_backend: str | None = None
    quantization: str | None = None  # a registered weight format; None = the checkpoint's, if any
    enforce_eager: bool = False  # True: every step runs the module forward (no step-graph replay)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for; -1 = the vocabulary size
    logprobs_mode: str = "raw_logprobs"  # requests' default (SamplingParams.logprobs_mode: vLLM's four names)

    def __post_init__(self) -> None:
        _require(self.model is None or isinstance(self.model, str), "model", "a path or name (str) or None", self.model)
        _require(str(self.dtype) in _DTYPES or not isinstance(self.dtype, str), "dtype", f"one of {_DTYPES} or a torch.dtype", self.dtype)
        _require(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 1),
                 "max_model_len", "an integer >= 1 or None", self.max_model_len)
        _require(_is_int(self.seed) and self.seed >= 0, "seed", "an integer >= 0", self.seed)
        _require(isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda"),
                 "device", "'cpu', 'cuda' or 'cuda:N'", self.device)
        _require(isinstance(self.enforce_eager, bool), "enforce_eager", "True or False", self.enforce_eager)
        _require(_is_int(self.max_logprobs) and self.max_logprobs >= -1, "max_logprobs",
                 "an integer >= 0 or -1 (the vocabulary size)", self.max_logprobs)
        _require(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"one of {LOGPROBS_MODES}", self.logprobs_mode)
        if self.quantization is not None:
            from pagellm.quantization import list_quantization_methods  # noqa: PLC0415 (torch; only when asked)

            methods = list_quantization_methods()
            _require(self.quantization in methods, "quantization", f"None or a registered method {methods}",
                     self.quantization)

    def torch_dtype(self, checkpoint_dtype=None):
        """The dtype to load weights in. "auto" follows the checkpoint's config (`checkpoint_dtype`, its
        torch_dtype), except that a float32 checkpoint runs in bfloat16 on CUDA; no dtype in the config
        means float32 (bfloat16 on CUDA)."""
        import torch

        if not isinstance(self.dtype, str):
            return self.dtype
        d = self.dtype
        if d == "auto":
            on_cuda = self.device.startswith("cuda")
            if checkpoint_dtype in (torch.bfloat16, torch.float16):
                return checkpoint_dtype
            return torch.bfloat16 if on_cuda else torch.float32
        return {
            "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
            "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        }[d]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gb: float | None = None  # explicit KV budget (GiB)
    kv_cache_fraction: float = 0.9  # else: this fraction of the free memory after the weights
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # override the computed number of blocks (tests, tuning)
    watermark: float = 0.01
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype; "int8" / "fp8_e4m3": quantized (kv_cache_dtypes())

    def __post_init__(self) -> None:
        bs = self.block_size
        _require(_is_int(bs) and 1 <= bs <= 256 and (bs & (bs - 1)) == 0, "block_size", "a power of two in [1, 256]", bs)
        _require(self.kv_cache_memory_gb is None or (isinstance(self.kv_cache_memory_gb, (int, float))
                 and math.isfinite(self.kv_cache_memory_gb) and self.kv_cache_memory_gb > 0),
                 "kv_cache_memory_gb", "a number > 0 or None", self.kv_cache_memory_gb)
        _require(isinstance(self.kv_cache_fraction, (int, float)) and 0.0 < self.kv_cache_fraction <= 1.0,
                 "kv_cache_fraction", "in (0, 1]", self.kv_cache_fraction)
        _require(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "a bool", self.enable_prefix_caching)
        _require(self.num_kv_blocks is None or (_is_int(self.num_kv_blocks) and self.num_kv_blocks >= 1),
                 "num_kv_blocks", "an integer >= 1 or None", self.num_kv_blocks)
        _require(isinstance(self.watermark, (int, float)) and 0.0 <= self.watermark < 1.0, "watermark", "in [0, 1)", self.watermark)
        allowed = kv_cache_dtypes()
        _require(self.kv_cache_dtype in allowed, "kv_cache_dtype", f"one of {allowed}", self.kv_cache_dtype)

    def cpp_kwargs(self, num_blocks: int) -> dict[str, Any]:
        """Keyword arguments of pagellm._C.Scheduler for the C++ CacheConfig."""
        return {
            "num_blocks": int(num_blocks),
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "watermark": float(self.watermark),
        }


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = max(2048, max_model_len) without chunking; 2048 with
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0  # vLLM's name: > 0 caps one request's prefill chunk at this many tokens

    def __post_init__(self) -> None:
        _require(_is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1", self.max_num_seqs)
        _require(_is_int(self.max_model_len) and self.max_model_len >= 1, "max_model_len", "an integer >= 1", self.max_model_len)
        if self.max_num_batched_tokens is None:
            default = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
            object.__setattr__(self, "max_num_batched_tokens", default)
        _require(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", "an integer >= 1", self.max_num_batched_tokens)
        if not self.enable_chunked_prefill:
            _require(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                     f">= max_model_len ({self.max_model_len}) without chunked prefill", self.max_num_batched_tokens)
        _require(self.policy in _POLICIES, "policy", f"one of {_POLICIES}", self.policy)
        _require(_is_int(self.long_prefill_token_threshold) and self.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold", "an integer >= 0 (0 = off)", self.long_prefill_token_threshold)
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            _require(False, "long_prefill_token_threshold", "0 without chunked prefill (it sets the chunk size)",
                     self.long_prefill_token_threshold)

    @property
    def max_prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in a step (what KV sizing of a sliding window counts)."""
        threshold = self.long_prefill_token_threshold
        return min(self.max_num_batched_tokens, threshold) if threshold else self.max_num_batched_tokens

    def cpp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of pagellm._C.Scheduler for the C++ SchedulerConfig."""
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "policy": self.policy,
            "long_prefill_token_threshold": self.long_prefill_token_threshold,
        }


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=lambda: ParallelConfig())
    # speculative decoding (vLLM's speculative_config dict, or a SpeculativeConfig); None: off
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA off (pagellm.lora)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:  # ValueError naming the allowed methods / keys / ranges
            object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
            pc = self.parallel_config
            pp_size = getattr(pc, "pipeline_parallel_size", 1)
            if pc.tensor_parallel_size > 1 or pp_size > 1:  # methods that need the target in the driver
                from pagellm.distributed.validation import check_speculative_parallel  # noqa: PLC0415

                check_speculative_parallel(pc.tensor_parallel_size, self.speculative_config, pp_size)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len


RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies


@dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: which executor reaches the workers (pagellm.engine.executor registry) and over
    how many tensor-parallel ranks x pipeline stages. None picks as vLLM does: "uni" for one rank, "mp"
    (worker processes on this host) for more; "uni" with more than one rank is refused. Model-dependent checks (heads divisible,
    ranks <= CPUs) run when the executor starts (pagellm.distributed.validation)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "uni": one worker in this process; "mp": worker processes
    pipeline_parallel_size: int = 1  # contiguous stages of decoder layers (pagellm.distributed.pipeline)
    # pipeline_parallel_size > 1 ("mp" or "ray"): one micro-batch per stage in flight (False: the stages take turns)
    pipeline_microbatching: bool = True
    # "ray" only: the cluster ("host:port", "ray://host:port", "auto"; None: RAY_ADDRESS, else a local Ray)
    # and how the ranks' placement-group bundles spread over its nodes
    ray_address: str | None = None
    ray_placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        _require(_is_int(tp) and tp >= 1, "tensor_parallel_size", "an integer >= 1", tp)
        _require(_is_int(pp) and pp >= 1, "pipeline_parallel_size", "an integer >= 1", pp)
        _require(isinstance(self.pipeline_microbatching, bool), "pipeline_microbatching", "a bool",
                 self.pipeline_microbatching)
        backend = self.distributed_executor_backend
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if self.world_size == 1 else "mp")
        _require(isinstance(self.distributed_executor_backend, str) and bool(self.distributed_executor_backend),
                 "distributed_executor_backend", "None or a registered executor name such as 'uni' or 'mp'",
                 self.distributed_executor_backend)
        if self.world_size > 1 and self.distributed_executor_backend == "uni":
            raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs one process per rank: "
                             f"distributed_executor_backend must be 'mp' (or None), got 'uni'")
        self._check_ray_options()

    def _check_ray_options(self) -> None:
        _require(self.ray_placement_strategy in RAY_PLACEMENT_STRATEGIES, "ray_placement_strategy",
                 f"one of {RAY_PLACEMENT_STRATEGIES}", self.ray_placement_strategy)
        _require(self.ray_address is None or (isinstance(self.ray_address, str) and bool(self.ray_address.strip())),
                 "ray_address", "None or a non-empty 'host:port' / 'ray://host:port' / 'auto'", self.ray_address)
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ValueError(f"ray_address is used by distributed_executor_backend='ray' only, got "
                             f"{self.distributed_executor_backend!r}")

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineArgs:
    """LLM(...) / LLMEngine.from_engine_args keyword arguments, turned into an EngineConfig once the
    model's own maximum length is known."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float | None = None  # alias of kv_cache_fraction
    kv_cache_fraction: float = 0.9
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None
    quantization: str | None = None
    enforce_eager: bool = False
    distributed_executor_backend: str | None = None  # None: "uni" for one rank, "mp" for more (vLLM's rule)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_microbatching: bool = True  # PP > 1: a micro-batch per stage in flight (False: one batch at a time)
    ray_address: str | None = None  # distributed_executor_backend="ray": the cluster (None: RAY_ADDRESS / local)
    ray_placement_strategy: str = "PACK"  # or "SPREAD": one rank per node where the cluster allows
    seed: int = 0
    device: str = "cpu"
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | raw_logits | processed_logprobs | processed_logits
    # e.g. {"method": "ngram", "num_speculative_tokens": 4}; methods: pagellm.spec_decode.list_proposers()
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None
    # LoRA adapters (pagellm.lora): off unless enable_lora; vLLM's names and defaults
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # refused here, before any model is opened
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        self.lora_config()  # ValueError for bad LoRA limits, before any model is opened
        ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend,
                       self.pipeline_parallel_size, self.pipeline_microbatching, ray_address=self.ray_address,
                       ray_placement_strategy=self.ray_placement_strategy)  # likewise

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unexpected engine arguments: {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            model=None if self.model is None else str(self.model),
            tokenizer=None if self.tokenizer is None else str(self.tokenizer),
            dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
            device=str(self.device), attention_backend=self.attention_backend, quantization=self.quantization,
            enforce_eager=self.enforce_eager, max_logprobs=self.max_logprobs, logprobs_mode=self.logprobs_mode,
        )

    def create_engine_config(self, model_max_len: int | None = None) -> EngineConfig:
        """`model_max_len`: the model's max_position_embeddings (caps / defaults max_model_len)."""
        mc = self.model_config()
        max_len = self.max_model_len
        if max_len is None:
            max_len = model_max_len or 2048
        elif model_max_len is not None and max_len > model_max_len:
            raise ValueError(f"max_model_len must be <= the model's maximum length ({model_max_len}), got {max_len}")
        mc = replace(mc, max_model_len=max_len)
        fraction = self.kv_cache_fraction if self.gpu_memory_utilization is None else self.gpu_memory_utilization
        cc = CacheConfig(
            block_size=self.block_size, kv_cache_memory_gb=self.kv_cache_memory_gb, kv_cache_fraction=fraction,
            enable_prefix_caching=self.enable_prefix_caching, num_kv_blocks=self.num_kv_blocks,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        sc = SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_len, enable_chunked_prefill=self.enable_chunked_prefill, policy=self.scheduling_policy,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        pc = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                            distributed_executor_backend=self.distributed_executor_backend,
                            pipeline_parallel_size=self.pipeline_parallel_size,
                            pipeline_microbatching=self.pipeline_microbatching, ray_address=self.ray_address,
                            ray_placement_strategy=self.ray_placement_strategy)
        return EngineConfig(model_config=mc, cache_config=cc, scheduler_config=sc, parallel_config=pc,
                            speculative_config=self.speculative_config, lora_config=self.lora_config())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["CacheConfig", "EngineArgs", "EngineConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig"]
