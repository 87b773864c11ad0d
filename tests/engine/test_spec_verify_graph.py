"""Speculative verify steps replayed from step graphs: a step whose rows all have at most MULTI_QUERY_MAX_LEN
tokens runs as one decode per token (the cpu backend's own multi-query plan), so it replays through the
decode graphs. Outputs, and every raw logit, must be the eager ones bit for bit in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="step graphs replay through pagellm._C")

from test_draft_tokens import OracleProposer, _assert_all_blocks_free, _greedy, _make_llm, _prompts  # noqa: E402

from pagellm.attention.base import AttentionMetadata  # noqa: E402
from pagellm.engine.model_runner import _replays_as_decode, _rows_as_decode_tokens  # noqa: E402

MAX_TOKENS = 40
PROMPT_LENS = [19, 33, 24, 40]  # longer than MULTI_QUERY_MAX_LEN: prefills stay eager, every graph key > 1 is a verify


def _params():
    return _greedy(MAX_TOKENS, logprobs=5, logprobs_mode="raw_logits")


def _run(path, prompts, batch, dtype, eager, proposer_for):
    llm = _make_llm(path, dtype=dtype, max_num_seqs=batch, enforce_eager=eager)
    eng = llm.llm_engine
    if proposer_for is not None:
        eng.set_proposer(proposer_for())  # not adaptive: every row drafts, the verify rows are what is tested
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
    _assert_all_blocks_free(eng)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logits = [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs] for o in outs]
    return tokens, logits, eng


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 4])
def test_replayed_verify_steps_equal_eager_bit_for_bit(tiny_llama_dir, tiny_tokenizer, dtype, batch):
    vocab = len(tiny_tokenizer)
    prompts = _prompts(vocab, PROMPT_LENS, seed=5)
    plain_tokens, _, _ = _run(tiny_llama_dir, prompts, batch, dtype, eager=True, proposer_for=None)
    reference = {tuple(p): t for p, t in zip(prompts, plain_tokens)}
    # right and wrong drafts: rows of 1 + 3 tokens accepted partly, so the step's token counts vary
    proposer = lambda: OracleProposer(3, reference, vocab, p_wrong=0.5, seed=1, strict=False)  # noqa: E731
    eager_tokens, eager_logits, eager_eng = _run(tiny_llama_dir, prompts, batch, dtype, True, proposer)
    tokens, logits, eng = _run(tiny_llama_dir, prompts, batch, dtype, False, proposer)
    assert eager_eng.runner.step_graphs is None
    graphs = eng.runner.step_graphs
    verify_replays = sum(n for (num_tokens, _), n in graphs.num_replays_by_key.items() if num_tokens > batch)
    assert verify_replays > 0, graphs.num_replays_by_key
    assert 0 < eng.spec_stats.num_accepted_draft_tokens < eng.spec_stats.num_draft_tokens
    assert tokens == eager_tokens
    assert logits == eager_logits  # exact floats, every position
    if dtype == "bfloat16" or batch == 1:
        assert tokens == plain_tokens  # bf16 batch invariance; fp32 at batch 1 has no near-ties here either


def _metadata(q_lens, seq_lens, width=3):
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    n = int(qsl[-1])
    tables = torch.arange(len(q_lens) * width, dtype=torch.int32).view(len(q_lens), width)
    num_decode = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))
    return AttentionMetadata(num_reqs=len(q_lens), num_tokens=n, num_decode_reqs=num_decode,
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                             slot_mapping=torch.arange(n, dtype=torch.int64), block_tables=tables,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl)


def test_rows_as_decode_tokens_gives_each_token_its_row_table_and_position():
    md = _metadata([1, 4, 2], [10, 7, 30])
    assert _replays_as_decode(md)
    flat = _rows_as_decode_tokens(md)
    assert (flat.num_reqs, flat.num_tokens, flat.num_decode_reqs, flat.max_query_len) == (7, 7, 7, 1)
    assert flat.seq_lens.tolist() == [10, 4, 5, 6, 7, 29, 30]  # each token's own position + 1
    assert flat.block_tables.tolist() == [[0, 1, 2]] + [[3, 4, 5]] * 4 + [[6, 7, 8]] * 2
    assert flat.query_start_loc.tolist() == list(range(8))
    assert flat.slot_mapping is md.slot_mapping


def test_long_rows_stay_eager():
    assert not _replays_as_decode(_metadata([1, 17], [5, 40]))
    empty = _metadata([2], [3])
    empty.num_tokens = 0
    assert not _replays_as_decode(empty)
