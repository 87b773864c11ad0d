"""A draft with the target's KV layout copies the target's KV of a sequence's committed tokens instead of computing
them (spec_decode/draft_kv_reuse.py), on the tiny random Llama (fp32): outputs stay plain decoding's, the draft's
rows are the target's, drafts stay right, the option turns it off, other layouts never copy, blocks come back."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import (  # noqa: E402
    _assert_all_blocks_free,
    _generate,
    _greedy,
    _make_llm,
    _reference,
    _tie_free_prompts,
)

from pagellm import SamplingParams  # noqa: E402
from pagellm.spec_decode.draft_kv_reuse import MIN_REUSED_TOKENS, layout_mismatch  # noqa: E402
from pagellm.spec_decode.draft_model import DraftModelProposer  # noqa: E402


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


def _draft_llm(path, **options):
    """The target's own checkpoint loaded again as its draft: every layer, the same KV layout."""
    return _make_llm(path, max_model_len=256, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "model": str(path), "adaptive": False, **options})


def _assert_draft_blocks_free(proposer: DraftModelProposer) -> None:
    bm = proposer.runner.block_manager
    assert proposer.num_tracked_seqs == 0 and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("reuse", [True, False])
def test_outputs_equal_plain_and_drafts_stay_right(tiny_llama_dir, vocab, reuse):
    lens = [MIN_REUSED_TOKENS + 24, 5, MIN_REUSED_TOKENS + 3]  # the short one is computed by the draft
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), lens, seed=17)
    ref_outs, _, _ = _reference(tiny_llama_dir, prompts, _greedy())
    llm = _draft_llm(tiny_llama_dir, reuse_target_kv=reuse)
    eng = llm.llm_engine
    proposer = eng.proposer
    assert (proposer.target_kv is not None) == reuse
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    stats = eng.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9  # the target's rows serve its own weights
    # at its first decode each long prompt's KV comes from the target (the new token's is computed); the short one's
    # is computed
    assert proposer.num_reused_tokens == (sum(n for n in lens if n >= MIN_REUSED_TOKENS) if reuse else 0)
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


def test_the_copied_rows_are_the_targets(tiny_llama_dir, vocab):
    prompt = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), [MIN_REUSED_TOKENS * 2 + 5], seed=5)[0]
    llm = _draft_llm(tiny_llama_dir)
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8))
    eng.step()  # prefill: the target holds the prompt's KV
    eng.step()  # the first decode: the draft copies it, then drafts
    proposer, bs = eng.proposer, eng.config.cache_config.block_size
    target_table, draft_table = eng.scheduler.get_block_table("r"), proposer.runner.block_manager.get_block_table("r")
    target, draft = eng._driver_worker.kv_caches, proposer.runner.kv_caches
    for pos in range(len(prompt)):
        tb, db, off = target_table[pos // bs], draft_table[pos // bs], pos % bs
        for layer in target.layer_ids:
            for name in ("key_cache", "value_cache"):
                t, d = getattr(target[layer], name), getattr(draft[layer], name)
                assert torch.equal(t[tb, :, off], d[db, :, off]), (pos, layer, name)
    while eng.has_unfinished_requests():
        eng.step()
    _assert_all_blocks_free(eng)
    _assert_draft_blocks_free(proposer)


def test_other_layouts_never_copy(tiny_llama_dir, vocab):
    """A first-layer self-draft caches one layer of the target's two: computed, as before."""
    llm = _make_llm(tiny_llama_dir, max_model_len=256, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "num_layers": 1})
    proposer = llm.llm_engine.proposer
    assert proposer.target_kv is None
    target = llm.llm_engine._driver_worker.kv_caches
    assert "layers" in layout_mismatch(proposer.runner.kv_caches, target)
    assert layout_mismatch(target, target) is None


def test_bad_option_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="reuse_target_kv"):
        _draft_llm(tiny_llama_dir, reuse_target_kv="yes")
