"""A snapshot of the engine's load: what serving dashboards and /metrics report."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagellm.spec_decode import SpecDecodeStats


@dataclass
class EngineStats:
    """A snapshot taken by the engine thread after each step (read without touching the engine)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0          # fraction of KV blocks in use, 0..1
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    prefix_cache_queries: int = 0        # cumulative tokens looked up in the prefix cache
    prefix_cache_hits: int = 0           # cumulative tokens found
    num_steps: int = 0
    timestamp: float = 0.0
    spec_decode: SpecDecodeStats | None = None  # a copy of LLMEngine.spec_stats (None: no proposer)
    kv_cache_bytes_per_token: int | None = None  # KV bytes one token of context takes, all layers (None: unknown)

    @staticmethod
    def spec_snapshot(engine) -> SpecDecodeStats | None:
        """A copy of the engine's speculative-decoding counters, safe to read from another thread."""
        if getattr(engine, "proposer", None) is None:
            return None
        s = engine.spec_stats
        return replace(s, num_drafts_per_position=list(s.num_drafts_per_position),
                       num_accepted_per_position=list(s.num_accepted_per_position))

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
