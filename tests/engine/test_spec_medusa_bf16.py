"""bf16 Medusa tree verification on a tiny random Llama: greedy output is token-identical to plain decoding at
batch 1 and 4, and every position's top-5 raw logits are the same floats (the CPU tree kernel attends each node
exactly like a plain decode of its path, ops/test_tree_attention.py), with accepted paths whose KV had to move."""

from __future__ import annotations

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import _assert_all_blocks_free, _generate, _make_llm  # noqa: E402
from test_spec_bf16_invariance import _params, _top_logits  # noqa: E402
from test_spec_medusa import (  # noqa: E402,F401 (fixtures)
    SKEWED_TREE,
    hf_base,
    kv_moves,
    test_prompts,
    trained_heads_dir,
    vocab,
)

KW = dict(dtype="bfloat16", block_size=4, num_kv_blocks=256)


@pytest.fixture(scope="module")
def plain_bf16(tiny_llama_dir, test_prompts):
    prompts = test_prompts[4]
    outs = _generate(_make_llm(tiny_llama_dir, max_num_seqs=1, **KW), prompts, _params())
    return prompts, [list(o.token_ids) for o in outs], _top_logits(outs)


@pytest.mark.parametrize("batch,tree", [(1, SKEWED_TREE), (4, "default"), (4, SKEWED_TREE)])
def test_bf16_greedy_tree_medusa_equals_plain(tiny_llama_dir, plain_bf16, trained_heads_dir, kv_moves, batch, tree):
    prompts, ref_tokens, ref_logits = plain_bf16
    config = {"method": "medusa", "num_speculative_tokens": 3, "model": str(trained_heads_dir), "tree": tree}
    llm = _make_llm(tiny_llama_dir, max_num_seqs=batch, speculative_config=config, **KW)
    outs = _generate(llm, prompts, _params())
    assert [list(o.token_ids) for o in outs] == ref_tokens
    assert _top_logits(outs) == ref_logits
    stats = llm.llm_engine.spec_stats
    assert stats.num_proposer_errors == 0 and 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens, stats
    assert sum(kv_moves) > 0  # accepted paths that were not the leading drafts: their KV moved
    _assert_all_blocks_free(llm.llm_engine)
