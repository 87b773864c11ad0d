"""Fixtures for the op tests (helpers live in op_helpers.py)."""

from __future__ import annotations

import pytest

from ops.op_helpers import DEVICES


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """"cpu", and "cuda" when a GPU is present (so the CUDA kernels reuse these tests)."""
    return request.param
