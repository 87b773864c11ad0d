"""Speculative decoding: the proposer contract (base.py), methods by name and `SpeculativeConfig` (registry.py),
and the step's bookkeeping of spec rows (batch.py).
Verification lives in sampling/rejection.py; the engine wires them up in LLMEngine.step()."""

from pagellm.spec_decode.base import (
    MAX_SPECULATIVE_TOKENS,
    BaseProposer,
    DraftRequest,
    SpecDecodeStats,
    check_proposals,
)
from pagellm.spec_decode.batch import SpecRows, split_spec_rows
from pagellm.spec_decode.registry import (
    ProposerContext,
    SpeculativeConfig,
    create_proposer,
    list_proposers,
    register_proposer,
)
from pagellm.spec_decode import ngram  # noqa: E402,F401  (registers "ngram")
from pagellm.spec_decode import draft_model  # noqa: E402,F401  (registers "draft_model")
from pagellm.spec_decode import medusa  # noqa: E402,F401  (registers "medusa")

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "BaseProposer",
    "DraftRequest",
    "ProposerContext",
    "SpecDecodeStats",
    "SpecRows",
    "SpeculativeConfig",
    "check_proposals",
    "create_proposer",
    "list_proposers",
    "register_proposer",
    "split_spec_rows",
]
