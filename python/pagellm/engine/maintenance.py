"""Between-steps operations on a whole engine: warm-up, in-place weight updates and sleep / wake.

`LLMEngine`, `LLM` and `AsyncLLM` expose these as thin methods; the work on the model and the KV cache is
Worker methods reached through `collective_rpc` (engine/weight_update.py, engine/sleep.py). What belongs to
the engine is done here: refusing while asleep or busy, the prefix cache (its entries hold KV computed by
the old weights, or KV that sleep threw away), and a proposer's own state (a self-draft shares the
target's modules; its cache and captured steps are stale after an update).
"""

from __future__ import annotations

import random
import time
from typing import Any, Iterable

from pagellm.engine.sleep import SLEEP_LEVELS
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode import SpecDecodeStats


class EngineSleepingError(RuntimeError):
    """The engine is asleep (its KV cache, maybe its weights, are released): wake_up() before generating."""


def check_awake(engine, action: str) -> None:
    level = getattr(engine, "sleep_level", None)
    if level is not None:
        raise EngineSleepingError(f"cannot {action}: the engine is asleep (level {level}); call wake_up() first")


def _after_state_change(engine, reset_prefix_cache: bool) -> bool:
    """Forget what depended on the old weights / cache contents; True when the prefix cache was reset."""
    reset_proposer = getattr(engine.proposer, "reset_state", None)
    if reset_proposer is not None:
        reset_proposer()
    return bool(engine.reset_prefix_cache()) if reset_prefix_cache else False


def run_weight_update(engine, rpc_method: str, args: tuple, kwargs: dict[str, Any],
                   reset_prefix_cache: bool = True) -> dict[str, Any]:
    """Run one of the Worker's update_weights* methods on every worker, then reset what the old weights
    computed. Returns {"num_tensors", "prefix_cache_reset"}. Any refusal (WeightUpdateError, TypeError)
    happens before a parameter changes."""
    check_awake(engine, "update weights")
    if not isinstance(reset_prefix_cache, bool):
        raise TypeError(f"reset_prefix_cache must be a bool, got {type(reset_prefix_cache).__name__}")
    counts = engine.collective_rpc(rpc_method, args, kwargs)
    return {"num_tensors": int(counts[0]), "prefix_cache_reset": _after_state_change(engine, reset_prefix_cache)}


def put_to_sleep(engine, level: int = 1) -> dict[str, Any]:
    """Release the KV cache on every worker and the proposer's own (a draft model's; level 2: the weights
    too). Refused (RuntimeError) with requests unfinished or when already asleep; ValueError for a level not
    in SLEEP_LEVELS. Returns {"level", "freed_bytes"} (the driver worker's measured drop plus the proposer's)."""
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
    check_awake(engine, "sleep")
    if engine.has_unfinished_requests():
        raise RuntimeError(f"cannot sleep with {engine.get_num_unfinished_requests()} requests unfinished; "
                           "wait for them or abort them first")
    _after_state_change(engine, reset_prefix_cache=True)  # the cache contents are about to be dropped
    results = engine.collective_rpc("sleep", (level,))
    engine.sleep_level = level  # before the proposer: if it fails, wake_up still restores the workers
    proposer_sleep = getattr(engine.proposer, "sleep", None)  # a draft model's own KV cache (and weights)
    proposer_freed = proposer_sleep(level) if proposer_sleep is not None else 0
    return {"level": level, "freed_bytes": int(results[0]["freed_bytes"]) + int(proposer_freed)}


def wake_engine(engine) -> None:
    """Restore what sleep released (zeroed KV cache, saved weights); a no-op when awake."""
    if getattr(engine, "sleep_level", None) is None:
        return
    engine.collective_rpc("wake_up")
    proposer_wake_up = getattr(engine.proposer, "wake_up", None)
    if proposer_wake_up is not None:  # after the workers: a self-draft's shared weights are theirs
        proposer_wake_up()
    engine.sleep_level = None


class MaintenanceMethods:
    """LLMEngine's warm-up and weights-and-memory methods (a mixin; the engine provides collective_rpc, proposer,
    add_request, step, reset_prefix_cache, has_unfinished_requests and `sleep_level`). Call between steps: from
    a trainer or an admin route."""

    sleep_level: int | None = None

    def warmup(self, prompt_lens: Iterable[int] = (7, 100, 300), max_tokens: int = 3) -> float:
        """Run throwaway requests so the first real ones do not pay one-time costs: oneDNN compiles a
        kernel the first time it meets a GEMM shape, pages of weights and caches are touched the first
        time, the thread pool starts. Each prompt runs alone and then all together (mixed prefill and
        decode steps, decode batches of several sizes). Afterwards no request is left, the prefix cache is
        empty and the token counters (and spec_stats) are as before. Returns the seconds it took. A server
        calls this before it accepts requests."""
        if self.has_unfinished_requests():
            raise RuntimeError("warmup() needs an idle engine")
        t0 = time.perf_counter()
        counters = self.num_prompt_tokens_total, self.num_generation_tokens_total, self.spec_stats
        self.spec_stats = SpecDecodeStats()  # warm-up drafts are not counted either
        rng = random.Random(0)
        lens = [max(1, min(int(n), self.max_model_len - max_tokens - 1)) for n in prompt_lens]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        batches = [[n] for n in lens] + [lens]
        for b, batch in enumerate(batches):
            for i, n in enumerate(batch):
                ids = [rng.randrange(self.vocab_size) for _ in range(n)]
                self.add_request(f"pagellm-warmup-{b}-{i}", {"prompt_token_ids": ids}, params)
            while self.has_unfinished_requests():
                self.step()
        self.reset_prefix_cache()
        self.num_prompt_tokens_total, self.num_generation_tokens_total, self.spec_stats = counters
        return time.perf_counter() - t0

    def update_weights(self, named_tensors, *, check_finite: bool = False, reset_prefix_cache: bool = True) -> dict:
        """Replace weights in place from (hf_name, tensor) pairs, all checked before any changes."""
        return run_weight_update(self, "update_weights", (list(named_tensors), check_finite), {}, reset_prefix_cache)

    def update_weights_from_disk(self, path, *, check_finite: bool = False, reset_prefix_cache: bool = True) -> dict:
        return run_weight_update(self, "update_weights_from_disk", (str(path), check_finite), {}, reset_prefix_cache)

    def update_weights_from_distributed(self, group, names, dtypes, shapes, *, src: int = 0,
                                        check_finite: bool = False, reset_prefix_cache: bool = True) -> dict:
        return run_weight_update(self, "update_weights_from_distributed",
                                 (group, names, dtypes, shapes, src, check_finite), {}, reset_prefix_cache)

    def sleep(self, level: int = 1) -> dict:
        return put_to_sleep(self, level)

    def wake_up(self) -> None:
        wake_engine(self)

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level is not None
