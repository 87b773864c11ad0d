"""Test helper (a plain module, importable from every test folder): the engine's C++ scheduler wrapped to count
what a test needs to see happen."""

from __future__ import annotations


class CountingScheduler:
    """The engine's scheduler, counting preempted requests over every schedule() (attribute `num_preempted`)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.num_preempted = 0

    def schedule(self):
        out = self._inner.schedule()
        self.num_preempted += len(out.preempted_request_ids)
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)
