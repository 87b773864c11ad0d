"""Hydra heads (hydra_heads.py) in the engine vs the trainer, on a tiny random Llama (fp32) with heads trained by the
trainer's own functions over a draft vocabulary: every chain the engine drafts is the trainer's served-way
prediction (the hidden state that gave the newest token, that token fed to head 1, each head's draft to the next,
draft indices mapped back), the engine's acceptance counters are the prefixes the greedy text confirms, the trainer's
chain walk over the engine's answers gives the engine's per-step rates, and greedy outputs with Hydra chains and
trees are token-identical to plain decoding at batch 1 and 4 with every block back."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from draft_heads_helpers import HIDDEN, NEW_TOKENS, NUM_HEADS, load_base, train_tiny_heads  # noqa: E402
from test_draft_tokens import _assert_all_blocks_free, _generate, _greedy, _make_llm  # noqa: E402

from pagellm.spec_decode import ProposerContext, SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.hydra_heads import HydraHeads, load_draft_heads  # noqa: E402
from pagellm.spec_decode.medusa import MedusaProposer, MedusaTreeProposer  # noqa: E402
from pagellm.spec_decode.medusa_train import evaluate, head_predictions, served_lm_head  # noqa: E402
from pagellm.spec_decode.medusa_train_data import final_hidden_states, ragged_positions  # noqa: E402


@pytest.fixture(scope="module")
def base(tiny_llama_dir):
    return load_base(tiny_llama_dir)


@pytest.fixture(scope="module")
def heads_and_prompts(tmp_path_factory, tiny_llama_dir, tiny_tokenizer, base):
    """Hydra heads over a draft vocabulary, trained the trainer's way on the tiny model's own greedy continuations
    of training prompts; held-out prompts (other seeds) for serving."""
    vocab_size = len(tiny_tokenizer)
    heads = HydraHeads(HIDDEN, vocab_size, num_heads=NUM_HEADS)
    heads.set_embedding(base.get_input_embeddings().weight)
    return train_tiny_heads(heads, base, tiny_llama_dir, vocab_size, tmp_path_factory.mktemp("hydra-dv"))


class RecordingHydra(MedusaProposer):
    """Keeps every (context token ids, drafted chain)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.proposed: list[tuple[list[int], list[int]]] = []

    def propose(self, requests):
        out = super().propose(requests)
        self.proposed += [(list(r.token_ids), list(out[r.seq_id])) for r in requests if out.get(r.seq_id)]
        return out


def _context(eng) -> ProposerContext:
    return ProposerContext(engine_config=eng.config, model_files=eng.model_files, tokenizer=eng.tokenizer,
                           vocab_size=eng.vocab_size, executor=eng.executor)


def _serve(tiny_llama_dir, heads_dir, prompts) -> tuple[RecordingHydra, object, list[list[int]]]:
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    config = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": NUM_HEADS,
                                          "model": str(heads_dir), "adaptive": False})
    proposer = RecordingHydra.from_config(config, _context(eng))
    assert isinstance(proposer.heads, HydraHeads) and proposer.heads.embed_weight is not None
    eng.set_proposer(proposer)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(NEW_TOKENS), use_tqdm=False)
    _assert_all_blocks_free(eng)
    return proposer, eng.spec_stats, [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def test_served_drafts_are_the_trainers_predictions(tiny_llama_dir, base, heads_and_prompts):
    heads_dir, prompts = heads_and_prompts
    proposer, stats, texts = _serve(tiny_llama_dir, heads_dir, prompts)
    heads = load_draft_heads(heads_dir)
    heads.set_embedding(base.get_input_embeddings().weight)
    lm_head = served_lm_head(heads, base.get_output_embeddings().weight.detach().float())
    assert len(proposer.proposed) > 2 * len(prompts)
    same, accepted, drafted = 0, 0, 0
    for context, drafts in proposer.proposed:
        text = next(t for t in texts if t[: len(context)] == context)
        n = len(context)  # the newest token text[n - 1] came from the hidden state at n - 2; head i guesses text[n + i]
        hidden = final_hidden_states(base, torch.tensor([text]))[0, n - 2 : n - 1]
        expect = head_predictions(heads, lm_head, hidden, heads.draft_vocab, torch.tensor([text[n - 1]]))
        same += drafts == expect[0, : len(drafts)].tolist()
        assert set(drafts) <= set(heads.draft_vocab.tolist())  # indices were mapped back to token ids
        run = next((i for i, (d, t) in enumerate(zip(drafts, text[n:])) if d != t), min(len(drafts), len(text) - n))
        accepted, drafted = accepted + run, drafted + len(drafts)
    # bf16 LM-head rows: a near-tie may round either way between HF's and the engine's fp32 states (~1e-5 apart)
    assert same >= 0.95 * len(proposer.proposed), (same, len(proposer.proposed))
    assert (stats.num_draft_tokens, stats.num_accepted_draft_tokens) == (drafted, accepted)
    assert 0 < accepted < drafted


def test_served_acceptance_is_the_trainers_chain_walk(tiny_llama_dir, base, heads_and_prompts):
    heads_dir, prompts = heads_and_prompts
    proposer, _, texts = _serve(tiny_llama_dir, heads_dir, prompts)
    heads, weight = load_draft_heads(heads_dir), base.get_output_embeddings().weight.detach().float()
    heads.set_embedding(base.get_input_embeddings().weight)
    ids = torch.tensor([sum(texts, [])])
    hidden = torch.cat([final_hidden_states(base, torch.tensor([t]))[0] for t in texts])[None]
    positions = ragged_positions([len(t) for t in texts], [len(p) - 1 for p in prompts], NUM_HEADS)
    acc = evaluate(heads, served_lm_head(heads, weight), hidden, ids, positions, vocab=heads.draft_vocab,
                   base_lm_head=lambda x: x @ weight.t())
    assert acc["base"] == 1.0  # the answers are the base model's own greedy tokens
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


@pytest.mark.parametrize("batch,tree", [(1, None), (4, None), (1, "default"), (4, [[0], [1], [0, 0], [0, 1], [1, 0]])])
def test_greedy_with_hydra_drafts_matches_plain_decoding(tiny_llama_dir, heads_and_prompts, batch, tree):
    heads_dir, served_prompts = heads_and_prompts
    prompts = served_prompts[:batch]  # tie-free for NEW_TOKENS > MAX_TOKENS
    ref = _generate(_make_llm(tiny_llama_dir), prompts, _greedy())
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    options = {"method": "medusa", "num_speculative_tokens": NUM_HEADS, "model": str(heads_dir), "adaptive": False}
    proposer = MedusaProposer.from_config(SpeculativeConfig.from_dict(
        {**options, **({"tree": tree} if tree is not None else {})}), _context(eng))
    assert isinstance(proposer, MedusaTreeProposer) == (tree is not None)
    eng.set_proposer(proposer)
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.spec_stats.num_accepted_draft_tokens > 0
    # a draft vocabulary's LM head: trees and chains were drafted from step graphs
    assert proposer._graphs.num_replays > 0
    _assert_all_blocks_free(eng)
