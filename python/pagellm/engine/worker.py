"""Worker: owns one device's share of the model, its KV cache, the attention backend and the model runner.

The engine never touches these directly: it reaches workers through an `Executor` (executor.py), and
everything a trainer or an experiment wants done on every worker (update weights, sleep, swap a kernel,
tensor-parallel set-up) is a Worker method called through `Executor.collective_rpc`.
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.config import EngineConfig
from pagellm.engine.model_runner import ModelRunner, ModelRunnerOutput
from pagellm.kv_cache import KVCacheConfig, allocate_kv_caches, make_kv_cache_config
from pagellm.logger import init_logger
from pagellm.threading_config import ThreadingConfig, apply_threading

logger = init_logger(__name__)


class Worker:
    """One model replica (the only one, in process, for now). `rank` is its index among the executor's workers."""

    def __init__(self, config: EngineConfig, model_files, rank: int = 0) -> None:
        from pagellm.attention import select_attention_backend  # noqa: PLC0415
        from pagellm.model_loader import build_model, resolve_dtype  # noqa: PLC0415

        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.rank = rank
        self.device = torch.device(mc.device)
        self.threading = apply_threading(ThreadingConfig.from_env()) if self.device.type == "cpu" else None
        self.dtype = mc.torch_dtype(resolve_dtype("auto", model_files.hf_config))
        self.model = build_model(model_files, self.dtype, self.device, quantization=mc.quantization)
        self.model.eval()
        # per-layer specs -> groups -> blocks that fit; ValueError when the block manager's one block
        # table per request cannot serve the groups, or one max-length request does not fit
        self.kv_cache_dtype = self.dtype if cc.kv_cache_dtype == "auto" else cc.kv_cache_dtype
        self.kv_cache_config: KVCacheConfig = make_kv_cache_config(
            self.model.kv_cache_specs(cc.block_size, self.kv_cache_dtype), self.device, sc.max_model_len, sc.max_num_seqs,
            cc.kv_cache_memory_gb, cc.kv_cache_fraction, cc.num_kv_blocks,
        )
        self.kv_caches = allocate_kv_caches(self.kv_cache_config, self.device)
        self.attn_backend = select_attention_backend(mc.attention_backend, self.device)
        self.runner = ModelRunner(self.model, self.attn_backend, self.kv_caches, self.device,
                                  use_step_graph=False if mc.enforce_eager else None)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    def execute_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> ModelRunnerOutput:
        """One step of the model on this worker (see ModelRunner.execute)."""
        return self.runner.execute(sched_out, prompt_logprob_rows, **kwargs)

    def invalidate_step_graphs(self) -> None:
        """Forget captured step graphs (after weight or KV-cache tensors were replaced, not copied into)."""
        self.runner.invalidate_step_graphs()

    def describe(self) -> dict[str, Any]:
        """What this worker holds (for logs, tests and `collective_rpc` smoke checks)."""
        return {"rank": self.rank, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "num_kv_blocks": self.num_kv_blocks, "attention_backend": self.attn_backend.name,
                "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                "step_graphs": self.runner.step_graphs is not None}
