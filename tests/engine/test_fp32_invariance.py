"""fp32 batch invariance and determinism on a tiny random Llama (fp32 linears run pagellm's linear_small_m at
every row count, ops/linear_dispatch.py): greedy output with speculative proposers is token-identical to plain
decoding with the same raw logits bit for bit; one sequence's logits (prompt and generated) are the same bits
alone, inside a batch of odd size, with its prompt cut into prefill chunks, and run again."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import _assert_all_blocks_free, _generate, _make_llm  # noqa: E402
from test_spec_bf16_invariance import _params as _raw_logit_params, _top_logits  # noqa: E402
from test_spec_ngram import _repetitive_prompts  # noqa: E402

from pagellm import SamplingParams  # noqa: E402

MAX_TOKENS = 24


def _params():
    return _raw_logit_params(MAX_TOKENS)


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


@pytest.fixture(scope="module")
def plain_fp32(tiny_llama_dir, vocab):
    """Copy-heavy prompts and their plain greedy fp32 continuations, one sequence at a time (batch 1)."""
    prompts = _repetitive_prompts(vocab, 7, seed=23)
    outs = _generate(_make_llm(tiny_llama_dir, dtype="float32", max_num_seqs=1), prompts, _params())
    return prompts, [list(o.token_ids) for o in outs], _top_logits(outs)


@pytest.mark.parametrize("batch,config", [
    (1, {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64}),
    (7, {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64}),
    (3, {"method": "draft_model", "num_speculative_tokens": 3, "num_layers": 1, "disable_by_batch_size": 64}),
])
def test_fp32_speculative_greedy_equals_plain(tiny_llama_dir, plain_fp32, batch, config):
    prompts, ref_tokens, ref_logits = plain_fp32
    llm = _make_llm(tiny_llama_dir, dtype="float32", max_num_seqs=batch, speculative_config=config)
    outs = _generate(llm, prompts, _params())
    eng = llm.llm_engine
    assert eng.spec_stats.num_proposer_errors == 0
    assert eng.spec_stats.num_accepted_draft_tokens > 0  # verify rows of several tokens did run
    _assert_all_blocks_free(eng)
    assert [list(o.token_ids) for o in outs] == ref_tokens
    assert _top_logits(outs) == ref_logits


def _prompt_logits(out):
    return [None if d is None else sorted((t, lp.logprob) for t, lp in d.items()) for d in out.prompt_logprobs]


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), _top_logits([o.outputs[0]])[0], _prompt_logits(o)) for o in outs]


def test_fp32_logits_alone_in_a_batch_chunked_and_again(tiny_llama_dir, vocab):
    rng = random.Random(5)
    # 300: a context over the decode kernel's 256-key partitions; 3 and 9: prompts that run as decode rows
    prompts = [[rng.randrange(5, vocab) for _ in range(n)] for n in (9, 3, 300, 17, 26)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5,
                            logprobs_mode="raw_logits", prompt_logprobs=3)
    llm = _make_llm(tiny_llama_dir, dtype="float32", max_model_len=512)
    together = _run(llm, prompts, params)
    assert _run(llm, prompts, params) == together  # deterministic: the same batch again, the same bits
    for i in (0, 2, 4):  # short prompts (multi-query decode rows) and a long one (prefill kernel)
        assert _run(llm, [prompts[i]], params)[0] == together[i]
    chunked = _make_llm(tiny_llama_dir, dtype="float32", max_model_len=512, long_prefill_token_threshold=64)
    assert _run(chunked, [prompts[2]], params)[0] == together[2]  # the 300-token prompt in chunks of 64
