"""Medusa heads with a draft vocabulary (medusa_heads.set_draft_vocab, medusa.draft_vocab_lm_head, the trainer's
--draft-vocab-size) on a tiny random Llama (fp32): the ids round-trip through the heads' files, bad ids are
refused, the proposer scores only those LM-head rows and drafts only those tokens, and greedy output stays
token-identical to plain decoding (chains and trees) with every block back."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import _assert_all_blocks_free, _generate, _greedy, _make_llm, _tie_free_prompts  # noqa: E402

from pagellm.spec_decode import ProposerContext, SpeculativeConfig  # noqa: E402
from pagellm.ops import quant_reference  # noqa: E402
from pagellm.quantization.int8 import quantize_weight_rows  # noqa: E402
from pagellm.spec_decode.medusa import MedusaProposer, draft_vocab_lm_head  # noqa: E402
from pagellm.spec_decode.medusa_heads import CONFIG_NAME, MedusaHeads  # noqa: E402
from pagellm.spec_decode.medusa_train import MedusaTrainConfig, frequent_tokens, train_medusa, vocab_coverage  # noqa: E402

HIDDEN = 64  # tiny_models.write_tiny_llama's default


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


def _heads(vocab: int, draft_size: int | None, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads(HIDDEN, vocab, num_heads=3)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    if draft_size:
        heads.set_draft_vocab(torch.randperm(vocab, generator=gen)[:draft_size])
    return heads


def test_draft_vocab_round_trips_and_bad_ids_are_refused(tmp_path, vocab):
    heads = _heads(vocab, 97)
    loaded = MedusaHeads.load(heads.save(tmp_path))
    assert torch.equal(loaded.draft_vocab, heads.draft_vocab) and loaded.draft_vocab.dtype == torch.long
    assert bool((heads.draft_vocab[1:] > heads.draft_vocab[:-1]).all())  # stored sorted
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["draft_vocab_size"] == 97
    for name, t in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert MedusaHeads.load(_heads(vocab, None).save(tmp_path / "full")).draft_vocab is None
    for bad in ([], [0, 0], [-1], [vocab]):
        with pytest.raises(ValueError, match="draft vocabulary"):
            heads.set_draft_vocab(torch.tensor(bad, dtype=torch.long))
    with pytest.raises(ValueError, match="shares|share"):
        MedusaHeads(HIDDEN, vocab, num_heads=2, share_lm_head=False).set_draft_vocab(torch.arange(5))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        MedusaTrainConfig(draft_vocab_size=-1).check()


def test_draft_vocab_lm_head_is_the_full_heads_rows():
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(301, HIDDEN, generator=gen), torch.randn(7, HIDDEN, generator=gen)
    ids = torch.randperm(301, generator=gen)[:53].sort().values
    head = draft_vocab_lm_head(weight, ids)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (7, 53)
    # int8 rows against int8 inputs: exactly the op's pure-torch reference over those rows ...
    q, scale = quantize_weight_rows(weight[ids])
    expect = torch.empty(7, 53)
    quant_reference.int8_linear(expect, x, q, scale, None, 0.0)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-4)
    # ... which is the full LM head's columns of those ids to int8 rounding
    torch.testing.assert_close(got, (x @ weight.t())[:, ids], rtol=2e-2, atol=0.15)
    xb = x.to(torch.bfloat16)  # any float dtype, any leading dims: widened to fp32 rows first
    torch.testing.assert_close(head(xb[None]), head(xb.float())[None], rtol=0, atol=0)


def test_frequent_tokens_and_coverage_count_labels():
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 50, (400, 3), generator=gen) ** 2 % 50  # skewed counts
    top = frequent_tokens(labels, 10)
    counts = Counter(labels.reshape(-1).tolist())
    assert sorted(counts[int(t)] for t in top) == sorted(counts.values())[-10:]
    assert vocab_coverage(labels, top) == pytest.approx(sum(counts[int(t)] for t in top) / labels.numel())


@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_greedy_with_a_draft_vocab_matches_plain_decoding(tmp_path, tiny_llama_dir, vocab, tree):
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), lens=[3, 9, 17, 26])
    ref = _generate(_make_llm(tiny_llama_dir), prompts, _greedy())
    heads_dir = _heads(vocab, vocab // 3).save(tmp_path / "heads")
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    options = {"method": "medusa", "num_speculative_tokens": 3, "model": str(heads_dir)}
    if tree:
        options["tree"] = tree
    context = ProposerContext(engine_config=eng.config, model_files=eng.model_files, tokenizer=eng.tokenizer,
                              vocab_size=eng.vocab_size, executor=eng.executor)
    proposer = MedusaProposer.from_config(SpeculativeConfig.from_dict(options), context)
    allowed = set(proposer.draft_vocab.tolist())
    drafted: list[int] = []
    propose = proposer.propose

    def recording(requests):
        out = propose(requests)
        drafted.extend(t for d in out.values() for t in d)
        return out

    proposer.propose = recording
    eng.set_proposer(proposer)
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert drafted and set(drafted) <= allowed
    assert eng.spec_stats.num_proposer_errors == 0
    _assert_all_blocks_free(eng)


def test_trainer_writes_the_most_frequent_answer_tokens(tmp_path, tiny_llama_dir):
    config = MedusaTrainConfig(data="chat", seq_len=12, num_train_seqs=6, num_eval_seqs=2, steps=3, num_heads=2,
                               draft_vocab_size=40)
    out, acc = train_medusa(tmp_path / "heads", str(tiny_llama_dir), config)
    heads = MedusaHeads.load(out)
    assert heads.draft_vocab is not None and heads.draft_vocab.numel() == 40
    assert 0.0 <= acc["draft_vocab_coverage"] <= 1.0


def test_no_hidden_states_over_the_batch_limit_and_drafting_resumes_under_it(tmp_path, tiny_llama_dir, vocab):
    """Above disable_by_batch_size no step gathers hidden states (no drafts follow); as requests finish and the
    batch falls under the limit, drafting resumes; greedy output stays plain decoding's."""
    prompts = _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), lens=[3, 9, 17, 26])
    lengths = [6, 10, 24, 30]  # the batch shrinks 4 -> 2 as the short requests finish
    ref = _make_llm(tiny_llama_dir).generate([{"prompt_token_ids": p} for p in prompts],
                                             [_greedy(n) for n in lengths], use_tqdm=False)
    heads_dir = _heads(vocab, None).save(tmp_path / "heads")
    llm = _make_llm(tiny_llama_dir, speculative_config={"method": "medusa", "num_speculative_tokens": 3,
                                                        "model": str(heads_dir), "disable_by_batch_size": 2,
                                                        "adaptive": False})
    eng = llm.llm_engine
    gathered: list[tuple[bool, int]] = []  # per step: over the limit?, rows gathered
    rows = eng._hidden_state_rows

    def recording(sched_out):
        out = rows(sched_out)
        gathered.append((eng._over_batch_limit, len(out)))
        return out

    eng._hidden_state_rows = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [_greedy(n) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    stats = eng.spec_stats
    assert stats.num_steps_over_batch_limit > 0 and stats.num_draft_tokens > 0
    assert any(over for over, _ in gathered) and all(n == 0 for over, n in gathered if over)
    assert any(n > 0 for over, n in gathered if not over)
    _assert_all_blocks_free(eng)
