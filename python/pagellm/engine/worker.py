"""Worker: owns one device's share of the model, its KV cache, the attention backend and the model runner.

The engine never touches these directly: it reaches workers through an `Executor` (executor.py), and
everything a trainer or an experiment wants done on every worker (update weights, sleep, swap a kernel,
tensor-parallel set-up) is a Worker method called through `Executor.collective_rpc`.
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.config import EngineConfig
from pagellm.distributed import get_pp_size, get_tp_size
from pagellm.distributed.pipeline import stage_step
from pagellm.engine.device_check import weights_do_not_fit
from pagellm.engine.model_runner import ModelRunner, ModelRunnerOutput
from pagellm.kv_cache import KVCacheConfig, allocate_kv_caches, make_kv_cache_config
from pagellm.logger import init_logger
from pagellm.lora.worker_lora import WorkerLoRAMixin
from pagellm.threading_config import ThreadingConfig, apply_threading

logger = init_logger(__name__)


class Worker(WorkerLoRAMixin):
    """One model replica (the only one, in process, for now). `rank` is its index among the executor's workers."""

    def __init__(self, config: EngineConfig, model_files, rank: int = 0) -> None:
        from pagellm.attention import select_attention_backend  # noqa: PLC0415
        from pagellm.model_loader import build_model, resolve_dtype  # noqa: PLC0415

        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.rank = rank
        self._sleep_state = None  # engine/sleep.py's SleepingState while asleep
        self.device = torch.device(mc.device)
        self.threading = apply_threading(ThreadingConfig.from_env()) if self.device.type == "cpu" else None
        self.dtype = mc.torch_dtype(resolve_dtype("auto", model_files.hf_config))
        try:
            self.model = build_model(model_files, self.dtype, self.device, quantization=mc.quantization)
        except torch.OutOfMemoryError as e:  # a clear error with the numbers, not torch's allocator message alone
            raise weights_do_not_fit(self.device, self.dtype, e) from e
        self.hidden_size = getattr(model_files.hf_config, "hidden_size", None)  # a pipeline stage's activations
        self.model.eval()
        # per-layer specs -> groups -> blocks that fit (a mixed sliding/full model: a hybrid cache, a block table per
        # group); ValueError when the groups' block sizes differ, or one max-length request does not fit
        self.kv_cache_dtype = self.dtype if cc.kv_cache_dtype == "auto" else cc.kv_cache_dtype
        self.kv_cache_config: KVCacheConfig = make_kv_cache_config(
            self.model.kv_cache_specs(cc.block_size, self.kv_cache_dtype), self.device, sc.max_model_len, sc.max_num_seqs,
            cc.kv_cache_memory_gb, cc.kv_cache_fraction, cc.num_kv_blocks,
            max_chunk_tokens=sc.max_prefill_chunk_tokens,
            free_sliding_blocks=get_pp_size() == 1,  # a stage's layers are not the whole model's
        )
        self.kv_caches = allocate_kv_caches(self.kv_cache_config, self.device)
        self.attn_backend = select_attention_backend(mc.attention_backend, self.device)
        # step graphs replay pagellm ops only; a tensor- or pipeline-parallel forward has collectives between them
        eager = mc.enforce_eager or get_tp_size() > 1 or get_pp_size() > 1
        self.runner = ModelRunner(self.model, self.attn_backend, self.kv_caches, self.device,
                                  use_step_graph=False if eager else None, max_batch=sc.max_num_seqs,
                                  max_blocks_per_seq=-(-sc.max_model_len // cc.block_size) + 1)
        if config.lora_config is not None:  # hooks on every Linear + the adapter slots (pagellm.lora)
            from pagellm.lora.manager import LoRAModelManager  # noqa: PLC0415

            self.lora_manager = LoRAModelManager(self.model, config.lora_config, self.dtype, self.device)
            self.runner.lora_state = self.lora_manager.step_state

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_config.num_blocks

    def execute_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> ModelRunnerOutput:
        """One step of the model on this worker (see ModelRunner.execute). A pipeline stage whose step raises
        still completes its activation receive / send (distributed.pipeline.stage_step)."""
        if get_pp_size() == 1:
            return self.runner.execute(sched_out, prompt_logprob_rows, **kwargs)
        with stage_step(int(sched_out.total_num_scheduled_tokens), int(self.hidden_size), self.dtype, self.device):
            return self.runner.execute(sched_out, prompt_logprob_rows, **kwargs)

    def invalidate_step_graphs(self) -> None:
        """Forget captured step graphs (after weight or KV-cache tensors were replaced, not copied into)."""
        self.runner.invalidate_step_graphs()

    # ---- weights and memory (reached through collective_rpc) --------------------------------------------
    def update_weights(self, named_tensors, check_finite: bool = False) -> int:
        """Load (hf_name, tensor) pairs in place, all checked first (engine/weight_update.py); returns how many."""
        from pagellm.engine.weight_update import update_model_weights  # noqa: PLC0415

        self._check_awake("update weights")
        num_loaded = update_model_weights(self.model, named_tensors, check_finite)
        self.invalidate_step_graphs()  # a method's post-processing may have replaced tensors
        return num_loaded

    def update_weights_from_disk(self, path: str, check_finite: bool = False) -> int:
        """update_weights with every tensor of a .safetensors file or a directory of them."""
        from pagellm.engine.weight_update import read_weights_from_disk  # noqa: PLC0415

        self._check_awake("update weights")
        return self.update_weights(read_weights_from_disk(path), check_finite)

    def update_weights_from_distributed(self, group, names, dtypes, shapes, src: int = 0,
                                        check_finite: bool = False) -> int:
        """Receive the tensors by broadcast from rank `src` of `group` (all of them, so the trainer never
        blocks), then update_weights with them (checked as a whole: refused ones change nothing)."""
        from pagellm.engine.weight_update import receive_weights_broadcast  # noqa: PLC0415

        self._check_awake("update weights")
        received = receive_weights_broadcast(group, names, dtypes, shapes, src, device=self.device)
        return self.update_weights(received, check_finite)

    @property
    def is_sleeping(self) -> bool:
        return self._sleep_state is not None

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV cache (level 2: the weights too, saved first; engine/sleep.py). Returns
        {"level", "freed_bytes"}: the measured drop of RSS (CPU) or reserved device memory."""
        from pagellm.engine.sleep import put_to_sleep  # noqa: PLC0415

        if self.is_sleeping:
            raise RuntimeError(f"worker {self.rank} is already asleep (level {self._sleep_state.level})")
        weights = list(self.model.parameters()) + list(self.model.buffers()) if level == 2 else []
        self._sleep_state = put_to_sleep(level, self.kv_caches.tensors(), weights, self.device)
        return {"level": level, "freed_bytes": self._sleep_state.freed_bytes}

    def wake_up(self) -> None:
        """Restore what sleep freed: a zeroed KV cache, the saved weights. A no-op when awake."""
        from pagellm.engine.sleep import wake_from_sleep  # noqa: PLC0415

        if self._sleep_state is not None:
            wake_from_sleep(self._sleep_state)
            self._sleep_state = None
            self.invalidate_step_graphs()  # storages were reallocated

    def _check_awake(self, action: str) -> None:
        if self.is_sleeping:
            raise RuntimeError(f"cannot {action} while asleep; call wake_up() first")

    def describe(self) -> dict[str, Any]:
        """What this worker holds (for logs, tests and `collective_rpc` smoke checks)."""
        return {"rank": self.rank, "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "num_kv_blocks": self.num_kv_blocks, "attention_backend": self.attn_backend.name,
                "kv_cache_bytes_per_token": self.kv_cache_config.bytes_per_token,
                "kv_cache_summary": self.kv_cache_config.describe_bytes_per_token(),
                "kv_cache_sliding_window": self.kv_cache_config.sliding_window,
                "kv_cache_extra_groups": self.kv_cache_config.extra_groups,
                "kv_cache_dtype": str(self.kv_cache_dtype).removeprefix("torch."),
                "step_graphs": self.runner.step_graphs is not None}
