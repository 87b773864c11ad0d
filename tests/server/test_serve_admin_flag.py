"""`pagellm serve --enable-admin-routes` reaches build_app (off unless given): `serve.run` with the engine and the
app replaced by stand-ins that record what they were called with (no model is loaded, no port is bound)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

import pagellm.engine.async_llm as async_llm_mod
import pagellm.entrypoints.openai.api_server as api_server_mod
from pagellm.entrypoints import serve


class _AppBuilt(Exception):
    """Raised by the stand-in build_app once it has recorded its arguments: run() stops before serving."""


def _build_app_kwargs(monkeypatch, argv: list[str]) -> dict:
    seen = {}

    def fake_build_app(llm, names, **kwargs):
        seen.update(kwargs)
        raise _AppBuilt

    fake_llm = SimpleNamespace(engine=SimpleNamespace(), max_model_len=64, shutdown=lambda: None)
    monkeypatch.setattr(async_llm_mod.AsyncLLM, "from_engine_args", classmethod(lambda cls, *a, **k: fake_llm))
    monkeypatch.setattr(api_server_mod, "build_app", fake_build_app)
    args = serve.add_serve_args(argparse.ArgumentParser()).parse_args(["--no-warmup", *argv])
    with pytest.raises(_AppBuilt):
        serve.run(args)
    return seen


def test_admin_routes_flag_reaches_build_app(monkeypatch):
    assert _build_app_kwargs(monkeypatch, ["--enable-admin-routes"])["enable_admin_routes"] is True


def test_admin_routes_off_by_default(monkeypatch):
    assert _build_app_kwargs(monkeypatch, [])["enable_admin_routes"] is False


def test_admin_routes_help_states_the_risk():
    text = serve.add_serve_args(argparse.ArgumentParser()).format_help()
    assert "--enable-admin-routes" in text and "replace its weights" in " ".join(text.split())
