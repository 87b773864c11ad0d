"""Shared by the weight-update tests: a perturbed copy of a checkpoint, and greedy outputs compared exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import SamplingParams

PROMPTS = ["hello world", "def main():", "the quick brown fox"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def perturbed(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in weights.items()}


def write_copy(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def greedy_outputs(llm, prompts=PROMPTS):
    """(token ids, top-2 logprobs per position) of each prompt; prompts may be strings or token-id lists."""
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(inputs, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def assert_same(a, b) -> None:
    for (tok_a, lp_a), (tok_b, lp_b) in zip(a, b):
        assert list(tok_a) == list(tok_b)
        for da, db in zip(lp_a, lp_b):
            assert da.keys() == db.keys()
            for t in da:
                assert da[t] == pytest.approx(db[t], abs=1e-5)
