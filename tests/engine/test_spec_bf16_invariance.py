"""bf16 batch invariance on a tiny random Llama: greedy output with each speculative proposer (ngram, a
draft model) is token-identical to plain decoding, with no tie-free prompt selection (verify rows of 1 + k
tokens must round exactly as single-token decode rows), and one sequence's logits are the same bits alone
and inside a batch of mixed-length sequences."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import _assert_all_blocks_free, _generate, _greedy, _make_llm  # noqa: E402
from test_spec_ngram import _repetitive_prompts  # noqa: E402

from pagellm import SamplingParams  # noqa: E402

MAX_TOKENS = 32


def _params(max_tokens: int = MAX_TOKENS):
    """Greedy, with each position's top-5 raw logits: compared as exact floats, far more sensitive than tokens."""
    return _greedy(max_tokens, logprobs=5, logprobs_mode="raw_logits")


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


@pytest.fixture(scope="module")
def plain_bf16(tiny_llama_dir, vocab):
    """Copy-heavy prompts and their plain greedy bf16 continuations, one sequence at a time (batch 1)."""
    prompts = _repetitive_prompts(vocab, 8, seed=17)
    outs = _generate(_make_llm(tiny_llama_dir, dtype="bfloat16", max_num_seqs=1), prompts, _params())
    return prompts, [list(o.token_ids) for o in outs], _top_logits(outs)


def _spec_tokens(path, prompts, batch, config):
    llm = _make_llm(path, dtype="bfloat16", max_num_seqs=batch, speculative_config=config)
    outs = _generate(llm, prompts, _params())
    eng = llm.llm_engine
    assert eng.spec_stats.num_proposer_errors == 0
    assert eng.spec_stats.num_accepted_draft_tokens > 0  # verify rows of several tokens did run
    _assert_all_blocks_free(eng)
    return [list(o.token_ids) for o in outs], _top_logits(outs)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("draft_length, k", [("match", 3), ("cost", 12)])
def test_bf16_ngram_greedy_equals_plain(tiny_llama_dir, plain_bf16, batch, draft_length, k):
    prompts, ref_tokens, ref_logits = plain_bf16
    config = {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": 64,
              "draft_length": draft_length}
    tokens, logits = _spec_tokens(tiny_llama_dir, prompts, batch, config)
    assert tokens == ref_tokens
    assert logits == ref_logits


@pytest.mark.parametrize("batch", [1, 8])
def test_bf16_self_draft_greedy_equals_plain(tiny_llama_dir, plain_bf16, batch):
    prompts, ref_tokens, ref_logits = plain_bf16
    config = {"method": "draft_model", "num_speculative_tokens": 3, "num_layers": 1, "disable_by_batch_size": 64}
    tokens, logits = _spec_tokens(tiny_llama_dir, prompts, batch, config)
    assert tokens == ref_tokens
    assert logits == ref_logits


def _top_logits(outs):
    """Per generated position: the top-5 raw logits as (token, value) pairs, exact floats."""
    return [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.logprobs] for o in outs]


def test_bf16_logits_alone_equal_logits_in_a_mixed_batch(tiny_llama_dir, vocab):
    rng = random.Random(3)
    # 300: a context over the decode kernel's 256-key partitions
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (9, 3, 300, 17, 26)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5,
                            logprobs_mode="raw_logits", prompt_logprobs=3)
    llm = _make_llm(tiny_llama_dir, dtype="bfloat16", max_model_len=512)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i in (0, 2):  # a short prompt (multi-query decode rows) and a long one (prefill kernel)
        alone = llm.generate([{"prompt_token_ids": prompts[i]}], params, use_tqdm=False)
        assert alone[0].outputs[0].token_ids == together[i].outputs[0].token_ids
        assert _top_logits([alone[0].outputs[0]]) == _top_logits([together[i].outputs[0]])
        prompt_lp = lambda o: [None if d is None else sorted((t, lp.logprob) for t, lp in d.items())  # noqa: E731
                               for d in o.prompt_logprobs]
        assert prompt_lp(alone[0]) == prompt_lp(together[i])


def test_bf16_prompt_split_bits_with_the_fma_prefill(tiny_llama_dir, vocab, monkeypatch):
    """A prompt cut differently - whole, in prefill chunks, or behind a prefix-cache hit (the cached blocks are not
    recomputed; the rest may take the multi-query decode path) - gives the same bits once bf16 prefill runs the FMA
    kernel (PAGELLM_PREFILL_BF16=0, read on every call): its online softmax keeps fp32 probabilities, as the decode
    kernel does. The default bf16 pair-dot prefill kernel rounds the probabilities to bf16 before P.V, so there a
    prompt's logits depend on how it was split (README, "Precision and batch invariance")."""
    monkeypatch.setenv("PAGELLM_PREFILL_BF16", "0")
    rng = random.Random(11)
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (30, 47, 70)]
    llm = _make_llm(tiny_llama_dir, dtype="bfloat16")
    whole = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(12), use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(12), use_tqdm=False)
    assert all(o.num_cached_tokens >= 16 for o in again)  # the second run did hit the prefix cache
    chunked_llm = _make_llm(tiny_llama_dir, dtype="bfloat16", enable_prefix_caching=False,
                            max_num_batched_tokens=16, enable_chunked_prefill=True)
    chunked = chunked_llm.generate([{"prompt_token_ids": p} for p in prompts], _params(12), use_tqdm=False)
    ref = [o.outputs[0] for o in whole]
    for outs in (again, chunked):
        assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.token_ids) for o in ref]
        assert _top_logits([o.outputs[0] for o in outs]) == _top_logits(ref)
    _assert_all_blocks_free(llm.llm_engine)
