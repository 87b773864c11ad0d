"""Speculative decoding: the proposer contract (base.py) and the step's bookkeeping of spec rows (batch.py).
Verification lives in sampling/rejection.py; the engine wires them up in LLMEngine.step()."""

from pagellm.spec_decode.base import (
    MAX_SPECULATIVE_TOKENS,
    BaseProposer,
    DraftRequest,
    SpecDecodeStats,
    check_proposals,
)
from pagellm.spec_decode.batch import SpecRows, split_spec_rows

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "BaseProposer",
    "DraftRequest",
    "SpecDecodeStats",
    "SpecRows",
    "check_proposals",
    "split_spec_rows",
]
