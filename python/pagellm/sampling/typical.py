"""Typical acceptance of draft tokens (Cai et al. 2024, "Medusa", section 3.3.1): opt-in, NOT lossless.

    LLM(model, speculative_config={"method": "medusa", ..., "acceptance": "typical",
                                   "posterior_threshold": 0.09, "posterior_alpha": 0.3})

A sampled row's draft d_j is accepted when the target's probability of it (after the row's logits processing:
temperature, top-k/p, ...) exceeds min(posterior_threshold, posterior_alpha * exp(-H(p_j))), H the entropy of the
target distribution p_j at that position: where the target is sure of itself the draft must be one of its likely
tokens, where it is unsure any plausible token passes. Drafts are accepted up to the first that fails; the row
then emits a draw from p_j itself (no residual distribution). More drafts are accepted than with rejection
sampling on high-entropy rows, at the price of exactness: outputs lean towards what the proposer suggests.
Greedy rows are verified exactly as always (the argmax rule), so their outputs do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACCEPTANCE_METHODS = ("rejection", "typical")
DEFAULT_POSTERIOR_THRESHOLD = 0.09  # Medusa's and vLLM's defaults
DEFAULT_POSTERIOR_ALPHA = 0.3


def _check_unit_interval(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TypicalAcceptance:
    """The typical-acceptance rule; both parameters in (0, 1] (ValueError otherwise)."""

    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA

    def __post_init__(self) -> None:
        _check_unit_interval(self.posterior_threshold, "posterior_threshold")
        _check_unit_interval(self.posterior_alpha, "posterior_alpha")

    def thresholds(self, probs: torch.Tensor) -> torch.Tensor:
        """probs [N, V] (rows sum to 1) -> [N]: the probability a token needs to be accepted at each row."""
        entropy = torch.special.entr(probs.float()).sum(dim=-1)
        return torch.clamp(self.posterior_alpha * torch.exp(-entropy), max=self.posterior_threshold)

    def num_accepted(self, probs: torch.Tensor, draft_token_ids: list[int]) -> int:
        """probs [k, V]: the target distributions the k drafts are checked against, in order. Returns how
        many leading drafts pass (target probability strictly above the row's threshold)."""
        if not draft_token_ids:
            return 0
        ids = torch.tensor(draft_token_ids, dtype=torch.int64, device=probs.device)
        p = probs.gather(1, ids.unsqueeze(1)).squeeze(1)
        passed = (p > self.thresholds(probs)).tolist()
        return next((j for j, ok in enumerate(passed) if not ok), len(passed))


def acceptance_rule(method: str, posterior_threshold: float | None = None,
                    posterior_alpha: float | None = None) -> TypicalAcceptance | None:
    """The rule a speculative_config names: None for "rejection" (lossless rejection sampling), a
    TypicalAcceptance for "typical". ValueError for another method, thresholds out of range, or thresholds
    given with "rejection" (they would silently do nothing)."""
    if method not in ACCEPTANCE_METHODS:
        raise ValueError(f"acceptance must be one of {list(ACCEPTANCE_METHODS)}, got {method!r}")
    if method == "rejection":
        given = [name for name, v in (("posterior_threshold", posterior_threshold),
                                      ("posterior_alpha", posterior_alpha)) if v is not None]
        if given:
            raise ValueError(f"{' and '.join(given)}: only used with acceptance='typical' (acceptance is 'rejection')")
        return None
    return TypicalAcceptance(DEFAULT_POSTERIOR_THRESHOLD if posterior_threshold is None else posterior_threshold,
                             DEFAULT_POSTERIOR_ALPHA if posterior_alpha is None else posterior_alpha)
