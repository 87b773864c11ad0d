"""What one engine step changed: where sampled tokens go and what the scheduler and outputs learn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagellm.engine.output_processor import FINISH_LENGTH, RequestState


def finished_status(finish_reason: str):
    """The scheduler status of a sequence Python decided to stop."""
    from pagellm import _C  # noqa: PLC0415

    return _C.RequestStatus.FINISHED_LENGTH if finish_reason == FINISH_LENGTH else _C.RequestStatus.FINISHED_STOPPED


class SampleTarget(NamedTuple):
    """Where a sampled token goes: sequence `index` of `state`; a new child is created on apply."""

    state: RequestState
    index: int
    is_new_child: bool


@dataclass
class StepUpdate:
    """What one step's sampled tokens changed, for the scheduler and the outputs."""

    token_by_seq: dict[str, int] = field(default_factory=dict)  # scheduled sequence id -> new token
    tokens_by_seq: dict[str, list[int]] = field(default_factory=dict)  # spec row's sequence id -> kept tokens
    forks: list[tuple[str, str, int]] = field(default_factory=list)  # (parent id, child id, first token)
    finished: list[tuple[str, Any]] = field(default_factory=list)  # (sequence id, RequestStatus)
    changed: dict[str, RequestState] = field(default_factory=dict)
