"""Speculative-decoding methods by name, and `SpeculativeConfig` (vLLM's `speculative_config` dict).

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})

A method is a `BaseProposer` subclass registered under a name; it parses its own options:

    @register_proposer("my_method")
    class MyProposer(BaseProposer):
        OPTIONS = ("my_option",)                 # the method's keys besides the common ones
        @classmethod
        def from_config(cls, config: SpeculativeConfig, context: ProposerContext) -> "MyProposer": ...
        @classmethod
        def check_options(cls, options) -> None: ...  # optional: ValueError for a bad option value
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from pagellm.sampling.typical import TypicalAcceptance, acceptance_rule
from pagellm.spec_decode.base import MAX_SPECULATIVE_TOKENS, BaseProposer

# keys every method accepts; the rest of the dict are the method's own options (its OPTIONS)
COMMON_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size", "adaptive", "adaptive_k")

# keys every method also accepts among its options: how sampled rows' drafts are accepted (sampling/typical.py)
ACCEPTANCE_KEYS = ("acceptance", "posterior_threshold", "posterior_alpha")

_PROPOSERS: dict[str, type[BaseProposer]] = {}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated `speculative_config`. `disable_by_batch_size`: no drafts in a step with more decode-ready
    sequences than this (None: the method's own default policy). `adaptive` (default True): each sequence
    drafts only while its recent acceptance pays for the measured verify cost (spec_decode/switch.py).
    `adaptive_k` (default False, opt-in, with `adaptive` only): each sequence asks for the number of drafts <= k
    that pays best (SpecSwitch.num_drafts); False: always k. `options`: the method's own keys."""

    method: str
    num_speculative_tokens: int
    disable_by_batch_size: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    adaptive: bool = True
    # off by default: in two loaded A/B runs (ngram copy, decode per CPU second) it lost 3 of 4 comparisons, e.g.
    # k = 3: 1.33x vs 1.43x for k drafts always (benchmarks/results/spec_decode_spec-speed-adaptive-k-2.md)
    adaptive_k: bool = False

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | "SpeculativeConfig") -> "SpeculativeConfig":
        """From the user's dict. ValueError for an unknown method, a bad count or an unknown key."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        method = config.get("method")
        if method not in _PROPOSERS:
            raise ValueError(f"speculative_config: unknown method {method!r}; registered: {list_proposers()}")
        k = config.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        limit = config.get("disable_by_batch_size")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be None or an integer >= 1, got {limit!r}")
        adaptive = config.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
        adaptive_k = config.get("adaptive_k", False)
        if not isinstance(adaptive_k, bool):
            raise ValueError(f"speculative_config: adaptive_k must be true or false, got {adaptive_k!r}")
        allowed = tuple(getattr(_PROPOSERS[method], "OPTIONS", ())) + ACCEPTANCE_KEYS
        options = {key: v for key, v in config.items() if key not in COMMON_KEYS}
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown} for method {method!r}; allowed: "
                             f"{sorted(COMMON_KEYS + allowed)}")
        _PROPOSERS[method].check_options(options)
        typical_acceptance_of(options)  # ValueError for a bad acceptance / threshold
        return cls(method, k, limit, options, adaptive, adaptive_k)

    @property
    def typical_acceptance(self) -> TypicalAcceptance | None:
        """None: sampled rows' drafts go through rejection sampling (lossless); else the typical-acceptance
        rule of "acceptance": "typical" (+ "posterior_threshold", "posterior_alpha"), not lossless."""
        return typical_acceptance_of(self.options)

    def to_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens, **self.options}
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        if not self.adaptive:
            out["adaptive"] = False
        if self.adaptive_k:
            out["adaptive_k"] = True
        return out


@dataclass(frozen=True)
class ProposerContext:
    """What a method may use to build itself: the target's configuration and loaded files; of its step state only
    `target_block_table` (read-only). `executor` reaches the target's workers (`collective_rpc`), e.g. to share
    weights for a self-draft; `model_files` is the target's opened checkpoint (hf_config, tokenizer, weights)."""

    engine_config: Any  # pagellm.config.EngineConfig
    model_files: Any
    tokenizer: Any
    vocab_size: int
    executor: Any = None
    # seq_id -> the target's block ids of that sequence (the scheduler's table): lets a draft with the target's KV
    # layout copy committed tokens' KV rather than recompute them (spec_decode/draft_kv_reuse.py)
    target_block_table: Any = None


def typical_acceptance_of(options: Mapping[str, Any]) -> TypicalAcceptance | None:
    """The acceptance rule in a config's options (None: rejection sampling); ValueError naming what is allowed."""
    try:
        return acceptance_rule(options.get("acceptance", "rejection"), options.get("posterior_threshold"),
                               options.get("posterior_alpha"))
    except ValueError as e:
        raise ValueError(f"speculative_config: {e}") from None


def register_proposer(name: str) -> Callable[[type[BaseProposer]], type[BaseProposer]]:
    """Class decorator registering a proposer class (with `from_config`) under `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError("speculative method name must be a non-empty string")

    def wrap(cls: type[BaseProposer]) -> type[BaseProposer]:
        if not (isinstance(cls, type) and issubclass(cls, BaseProposer)) or not hasattr(cls, "from_config"):
            raise TypeError(f"{cls!r} must subclass BaseProposer and define from_config(config, context)")
        if _PROPOSERS.get(name, cls) is not cls:
            raise ValueError(f"speculative method {name!r} is already registered by {_PROPOSERS[name].__name__}")
        _PROPOSERS[name] = cls
        return cls

    return wrap


def list_proposers() -> list[str]:
    return sorted(_PROPOSERS)


def create_proposer(config: Mapping[str, Any] | SpeculativeConfig, context: ProposerContext) -> BaseProposer:
    """The proposer a (validated) speculative_config names, built for the target in `context`."""
    config = SpeculativeConfig.from_dict(config)
    return _PROPOSERS[config.method].from_config(config, context)
