"""Shared by the distributed tests: every mp-executor wait is bounded, so a broken rank fails a test instead
of hanging CI."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="module")
def bounded_waits():
    old = os.environ.get("PAGELLM_MP_STEP_TIMEOUT_S")
    os.environ["PAGELLM_MP_STEP_TIMEOUT_S"] = "120"
    yield
    if old is None:
        os.environ.pop("PAGELLM_MP_STEP_TIMEOUT_S")
    else:
        os.environ["PAGELLM_MP_STEP_TIMEOUT_S"] = old
