"""The cpu attention backend's mixed steps: when the short rows (decodes, rows of <= MULTI_QUERY_MAX_LEN tokens)
come first and the long prefill rows after them, the kernels read q and write the output through views; that must
give exactly the bits of the gather / scatter path (which any other order takes)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from paged_model_utils import PagedRunner, make_backend, make_tiny_hf, random_prompts

from pagellm.attention import cpu_backend
from pagellm.model_loader import build_model, open_model

pytestmark = pytest.mark.skipif("cpu" not in __import__("paged_model_utils").available_backends(),
                                reason="needs the C++ extension (make install)")


def _run(model, prompts, force_gather: bool, monkeypatch) -> tuple[list[torch.Tensor], list]:
    plans = []
    init = cpu_backend._MultiQueryPlan.__init__

    def spy(self, md):
        init(self, md)
        if force_gather:
            self.num_short_first = None
        plans.append(self.num_short_first)

    monkeypatch.setattr(cpu_backend._MultiQueryPlan, "__init__", spy)
    runner = PagedRunner(model, make_backend("cpu"), 16, 80, len(prompts), seed=3)
    runner.step([(0, prompts[0]), (1, prompts[1])])
    outs = [runner.last_hidden.clone()]
    # decodes of 0 and 1, a short prompt (5 tokens), then a long one (37): short rows first -> views
    outs.append(runner.step([(0, [7]), (1, [9]), (2, prompts[2]), (3, prompts[3])]).clone())
    outs.append(runner.last_hidden.clone())
    # only long rows (no decode, no short row): the prefill call alone, through views
    outs.append(runner.step([(4, prompts[4])]).clone())
    # a long row before a short one: the gather / scatter path whatever force_gather says
    outs.append(runner.step([(0, [3]), (5, prompts[5]), (6, prompts[2])]).clone())
    monkeypatch.setattr(cpu_backend._MultiQueryPlan, "__init__", init)
    return outs, plans


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_short_first_views_equal_gather_scatter(tmp_path, monkeypatch, dtype):
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=1, head_dim=16, num_attention_heads=4,
                      num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "m")
    model = build_model(open_model(str(tmp_path / "m")), dtype=dtype)
    prompts = random_prompts([20, 33, 5, 37, 40, 29], hf.config.vocab_size, seed=2)
    fast, fast_plans = _run(model, prompts, False, monkeypatch)
    slow, slow_plans = _run(model, prompts, True, monkeypatch)
    assert fast_plans == [0, 7, 0, None]  # short tokens first (views: 0, 1 + 1 + 5, 0), then a long row first
    assert all(p is None for p in slow_plans)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
