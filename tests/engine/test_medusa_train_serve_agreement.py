"""Medusa heads drafted by the engine vs the trainer's view of the same text (issue 17: served acceptance far
below the heads' held-out accuracy). On a tiny random Llama (fp32) with heads trained by the trainer's own
functions over a draft vocabulary: every chain the engine drafts is the trainer's teacher-forced prediction at
the position whose hidden state gave the newest token (the serving LM head, draft indices mapped back to token
ids); the engine's acceptance counters are the drafts' longest prefixes that the greedy text confirms; and the
heads' served first-draft rate over the engine's steps matches the trainer's evaluation of the same answers
within sampling noise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from draft_heads_helpers import HIDDEN, NEW_TOKENS, NUM_HEADS, load_base, train_tiny_heads  # noqa: E402
from test_draft_tokens import _assert_all_blocks_free, _greedy, _make_llm  # noqa: E402

from pagellm.spec_decode import ProposerContext, SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.medusa import MedusaProposer  # noqa: E402
from pagellm.spec_decode.medusa_heads import MedusaHeads  # noqa: E402
from pagellm.spec_decode.medusa_train import evaluate, head_predictions, served_lm_head  # noqa: E402
from pagellm.spec_decode.medusa_train_data import final_hidden_states, ragged_positions  # noqa: E402


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_base(tiny_llama_dir)


@pytest.fixture(scope="module")
def heads_and_prompts(tmp_path_factory, tiny_llama_dir, tiny_tokenizer, base):
    """Shared-LM-head heads over a draft vocabulary, trained the trainer's way on the tiny model's own greedy
    continuations of training prompts; held-out prompts (other seeds) for serving."""
    vocab_size = len(tiny_tokenizer)
    heads = MedusaHeads(HIDDEN, vocab_size, num_heads=NUM_HEADS)
    return train_tiny_heads(heads, base, tiny_llama_dir, vocab_size, tmp_path_factory.mktemp("medusa-dv"))


class RecordingMedusa(MedusaProposer):
    """Keeps every (context token ids, drafted chain)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.proposed: list[tuple[list[int], list[int]]] = []

    def propose(self, requests):
        out = super().propose(requests)
        self.proposed += [(list(r.token_ids), list(out[r.seq_id])) for r in requests if out.get(r.seq_id)]
        return out


def _serve(tiny_llama_dir, heads_dir, prompts) -> tuple[RecordingMedusa, dict, list[list[int]]]:
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    config = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": NUM_HEADS,
                                          "model": str(heads_dir), "adaptive": False})
    context = ProposerContext(engine_config=eng.config, model_files=eng.model_files, tokenizer=eng.tokenizer,
                              vocab_size=eng.vocab_size, executor=eng.executor)
    proposer = RecordingMedusa.from_config(config, context)
    eng.set_proposer(proposer)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(NEW_TOKENS), use_tqdm=False)
    _assert_all_blocks_free(eng)
    return proposer, eng.spec_stats, [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def test_served_drafts_are_the_trainers_teacher_forced_predictions(tiny_llama_dir, base, heads_and_prompts):
    heads_dir, prompts = heads_and_prompts
    proposer, stats, texts = _serve(tiny_llama_dir, heads_dir, prompts)
    heads = MedusaHeads.load(heads_dir)
    lm_head = served_lm_head(heads, base.get_output_embeddings().weight.detach().float())
    assert len(proposer.proposed) > 2 * len(prompts)
    same, accepted, drafted = 0, 0, 0
    for context, drafts in proposer.proposed:
        text = next(t for t in texts if t[: len(context)] == context)
        n = len(context)  # the newest token text[n - 1] came from the hidden state at n - 2; head i guesses text[n + i]
        hidden = final_hidden_states(base, torch.tensor([text]))[0, n - 2 : n - 1]
        expect = head_predictions(heads, lm_head, hidden, heads.draft_vocab)[0, : len(drafts)].tolist()
        same += drafts == expect
        assert set(drafts) <= set(heads.draft_vocab.tolist())  # indices were mapped back to token ids
        run = next((i for i, (d, t) in enumerate(zip(drafts, text[n:])) if d != t), min(len(drafts), len(text) - n))
        accepted, drafted = accepted + run, drafted + len(drafts)
    # bf16 LM-head rows: a near-tie may round either way between HF's and the engine's fp32 states (~1e-5 apart)
    assert same >= 0.95 * len(proposer.proposed), (same, len(proposer.proposed))
    # the engine counts what the text confirms: the drafts' longest matching prefix, per verify
    assert (stats.num_draft_tokens, stats.num_accepted_draft_tokens) == (drafted, accepted)
    assert 0 < accepted < drafted


def test_served_acceptance_is_the_trainers_chain_walk(tiny_llama_dir, base, heads_and_prompts):
    """The trainer's evaluation walks each answer as the engine does (chain_walk: accept the longest run of right
    heads, jump past it); on the engine's own answers its per-step rates are the engine's. The per-position
    head-1 accuracy is higher: accepted runs skip easy positions."""
    heads_dir, prompts = heads_and_prompts
    proposer, _, texts = _serve(tiny_llama_dir, heads_dir, prompts)
    heads, weight = MedusaHeads.load(heads_dir), base.get_output_embeddings().weight.detach().float()
    ids = torch.tensor([sum(texts, [])])
    hidden = torch.cat([final_hidden_states(base, torch.tensor([t]))[0] for t in texts])[None]
    positions = ragged_positions([len(t) for t in texts], [len(p) - 1 for p in prompts], NUM_HEADS)
    acc = evaluate(heads, served_lm_head(heads, weight), hidden, ids, positions, vocab=heads.draft_vocab,
                   base_lm_head=lambda x: x @ weight.t())
    assert acc["base"] == 1.0  # the answers are the base model's own greedy tokens
    # the engine's verifies at positions the trainer labels fully (all K labels inside the text)
    steps = accepted = first = 0
    for context, drafts in proposer.proposed:
        text = next(t for t in texts if t[: len(context)] == context)
        n = len(context)
        if n + NUM_HEADS <= len(text):
            run = next((i for i, (d, t) in enumerate(zip(drafts, text[n:])) if d != t), len(drafts))
            steps, accepted, first = steps + 1, accepted + run, first + (run > 0)
    assert steps > 2 * len(prompts)
    assert acc["chain_head1"] == pytest.approx(first / steps, abs=0.05)
    assert acc["chain_accepted_len"] == pytest.approx(1 + accepted / steps, abs=0.08)
    assert 0.0 < acc["chain_head1"] <= acc["head1"] < 1.0
