"""The `medusa` proposer (spec_decode/medusa.py), its heads (medusa_heads.py) and trainer (medusa_train.py) on a
tiny random Llama (fp32): heads round-trip through their files, training lowers the loss, greedy outputs with
Medusa drafts are token-identical to plain decoding (batch 1 and 4), the proposer sees the hidden states a
plain HF forward computes at the position that gave each newest token, bad configurations are refused and
every block comes back."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import (  # noqa: E402
    MAX_TOKENS,
    _assert_all_blocks_free,
    _generate,
    _greedy,
    _make_llm,
    _tie_free_prompts,
)

from pagellm.spec_decode import ProposerContext, SpeculativeConfig, list_proposers  # noqa: E402
from pagellm import SamplingParams  # noqa: E402
from pagellm.engine import spec_step  # noqa: E402
from pagellm.engine.tree_step import pad_tree_step  # noqa: E402
from pagellm.spec_decode.medusa import MedusaProposer, MedusaTreeProposer  # noqa: E402
from pagellm.spec_decode.medusa_heads import CONFIG_NAME, MedusaHeads  # noqa: E402
from pagellm.spec_decode.medusa_train import (  # noqa: E402
    MedusaTrainConfig,
    frozen_lm_head,
    head_targets,
    medusa_loss,
    train_heads,
)
from pagellm.spec_decode.medusa_train_data import final_hidden_states, greedy_continuations  # noqa: E402

HIDDEN = 64  # conftest.write_tiny_llama's default


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


@pytest.fixture(scope="module")
def hf_base(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval().requires_grad_(False)


PROMPT_LENS = {1: [3], 4: [3, 9, 17, 26], "hidden": [5, 11]}


@pytest.fixture(scope="module")
def test_prompts(tiny_llama_dir, vocab):
    return {key: _tie_free_prompts(tiny_llama_dir, vocab, _greedy(), lens=lens) for key, lens in PROMPT_LENS.items()}


_TRAINED_HEADS: dict[str, object] = {}  # trained once per session for every test module importing the fixture


@pytest.fixture(scope="module")
def trained_heads_dir(tmp_path_factory, tiny_llama_dir, hf_base, vocab, test_prompts):
    """Heads (own LM heads) briefly trained on the tiny model's greedy continuations of the test prompts
    (self-distillation), so that many drafts are accepted and some rejected."""
    if str(tiny_llama_dir) not in _TRAINED_HEADS:
        _TRAINED_HEADS[str(tiny_llama_dir)] = _train_heads(tmp_path_factory, hf_base, vocab, test_prompts)
    return _TRAINED_HEADS[str(tiny_llama_dir)]


def _train_heads(tmp_path_factory, hf_base, vocab, test_prompts):
    window = min(min(lens) for lens in PROMPT_LENS.values()) + MAX_TOKENS  # every generated position
    ids, hidden = [], []
    for prompt in {tuple(p) for prompts in test_prompts.values() for p in prompts}:
        full = greedy_continuations(hf_base, torch.tensor([prompt]), len(prompt) + MAX_TOKENS)
        ids.append(full[0, -window:])
        hidden.append(final_hidden_states(hf_base, full)[0, -window:])
    heads = MedusaHeads(HIDDEN, vocab, num_heads=3, share_lm_head=False)
    heads.init_lm_heads_from(hf_base.get_output_embeddings().weight)
    config = MedusaTrainConfig(steps=200, batch_size=128, lr=1e-2, warmup_steps=5)
    train_heads(heads, frozen_lm_head(hf_base), torch.stack(hidden), torch.stack(ids), config)
    return heads.save(tmp_path_factory.mktemp("medusa-heads"))


@pytest.fixture(scope="module")
def random_shared_heads_dir(tmp_path_factory, vocab):
    return _randomize(MedusaHeads(HIDDEN, vocab, num_heads=3)).save(tmp_path_factory.mktemp("medusa-random"))


def _context(eng) -> ProposerContext:
    return ProposerContext(engine_config=eng.config, model_files=eng.model_files, tokenizer=eng.tokenizer,
                           vocab_size=eng.vocab_size, executor=eng.executor)


def _proposer(eng, k: int, heads_dir, cls=MedusaProposer) -> MedusaProposer:
    config = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": k, "model": str(heads_dir)})
    return cls.from_config(config, _context(eng))


def _randomize(heads: MedusaHeads, seed: int = 0) -> MedusaHeads:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return heads


# ---------------------------------------------------------------- heads and their files


@pytest.mark.parametrize("share", [True, False], ids=["shared-lm-head", "own-lm-heads"])
def test_heads_save_load_round_trip(tmp_path, vocab, share):
    heads = _randomize(MedusaHeads(HIDDEN, vocab, num_heads=3, num_layers=2, share_lm_head=share, base_model="tiny"))
    heads.save(tmp_path)
    loaded = MedusaHeads.load(tmp_path)
    config = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2
    assert (config["hidden_size"], config["vocab_size"], config["share_lm_head"]) == (HIDDEN, vocab, share)
    assert loaded.state_dict().keys() == heads.state_dict().keys()
    assert "medusa_head.2.1.linear.weight" in heads.state_dict()  # Medusa's reference names
    assert ("medusa_head.0.2.weight" in heads.state_dict()) == (not share)
    for name, t in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    lm_weight = torch.randn(vocab, HIDDEN)
    h = torch.randn(5, HIDDEN)
    torch.testing.assert_close(loaded(h, lambda x: x @ lm_weight.t()), heads(h, lambda x: x @ lm_weight.t()),
                               rtol=0, atol=0)
    # the forward is ResBlocks then the LM head, computed by hand
    lin = heads.medusa_head[1][0].linear, heads.medusa_head[1][1].linear
    x = h + torch.nn.functional.silu(lin[0](h))
    x = x + torch.nn.functional.silu(lin[1](x))
    expect = heads.medusa_head[1][2](x) if not share else x @ lm_weight.t()
    torch.testing.assert_close(heads(h, lambda x: x @ lm_weight.t())[:, 1], expect)


def test_fresh_heads_are_the_identity_before_the_lm_head(vocab):
    heads = MedusaHeads(HIDDEN, vocab, num_heads=2)
    h = torch.randn(3, HIDDEN)
    torch.testing.assert_close(heads.head_states(h), torch.stack([h, h], dim=1))


# ---------------------------------------------------------------- training


def test_trainer_loss_decreases(hf_base, vocab):
    gen = torch.Generator().manual_seed(1)
    starts, steps = torch.randint(5, vocab, (32, 1), generator=gen), torch.randint(1, 4, (32, 1), generator=gen)
    ids = (starts + steps * torch.arange(24)) % vocab  # arithmetic runs: the continuation is learnable
    hidden = final_hidden_states(hf_base, ids)
    lm_head = frozen_lm_head(hf_base)
    heads = MedusaHeads(HIDDEN, vocab, num_heads=3, share_lm_head=False)
    heads.init_lm_heads_from(hf_base.get_output_embeddings().weight)
    flat, labels = head_targets(ids, 3)
    assert torch.equal(labels[0], ids[0, 2:5])  # position 0: heads label tokens 2, 3, 4
    h_flat = hidden.reshape(-1, HIDDEN)[flat]
    with torch.no_grad():
        before = float(medusa_loss(heads(h_flat, lm_head), labels))
    losses = train_heads(heads, lm_head, hidden, ids, MedusaTrainConfig(steps=40, batch_size=128, lr=3e-3))
    with torch.no_grad():
        after = float(medusa_loss(heads(h_flat, lm_head), labels))
    assert len(losses) == 40 and after < 0.8 * before, (before, after)
    base_params = [p for p in hf_base.parameters()]
    assert not any(p.requires_grad for p in base_params)  # the base stayed frozen


def test_trainer_hidden_states_are_the_engines(tiny_llama_dir, hf_base, vocab):
    """What the trainer trains on is what the runner returns for the same tokens."""
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    prompt = list(range(7, 7 + 13))
    eng.add_request("a", {"prompt_token_ids": prompt}, _greedy(2))
    sched_out = eng.scheduler.schedule()
    result = eng.runner.execute(sched_out, [], hidden_state_rows=[0])
    expect = final_hidden_states(hf_base, torch.tensor([prompt]))[0]
    torch.testing.assert_close(result.hidden_states, expect, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the proposer in the engine


class RecordingMedusa(MedusaProposer):
    """Keeps every (seq_id, length, hidden state) the engine hands over."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[str, int, torch.Tensor]] = []

    def observe_hidden_states(self, seq_ids, num_tokens, hidden):
        super().observe_hidden_states(seq_ids, num_tokens, hidden)
        self.seen += [(s, int(n), hidden[i].clone()) for i, (s, n) in enumerate(zip(seq_ids, num_tokens))]


@pytest.mark.parametrize("batch,heads", [(1, "trained"), (4, "trained"), (4, "random-shared")])
def test_greedy_with_medusa_drafts_matches_plain_decoding(tiny_llama_dir, test_prompts, trained_heads_dir,
                                                          random_shared_heads_dir, batch, heads):
    prompts = test_prompts[batch]
    ref = _generate(_make_llm(tiny_llama_dir), prompts, _greedy())
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _proposer(eng, 3, trained_heads_dir if heads == "trained" else random_shared_heads_dir)
    eng.set_proposer(proposer)
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    stats = eng.spec_stats
    assert stats.num_proposer_errors == 0 and stats.num_draft_tokens > 0
    if heads == "trained":  # accepted and rejected drafts both occur
        assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens, stats
    _assert_all_blocks_free(eng)
    assert proposer.num_tracked_seqs == 0  # release() dropped every finished sequence's state


def _generate_greedy(eng, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Greedy-generate every prompt (request ids r0, r1, ...) to the end: {request id: prompt + output ids}."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, _greedy())
    full = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                full[out.request_id] = prompts[int(out.request_id[1:])] + list(out.outputs[0].token_ids)
    return full


def test_proposer_sees_the_hidden_state_of_the_newest_token(tiny_llama_dir, test_prompts, hf_base, trained_heads_dir):
    prompts = test_prompts["hidden"]
    eng = _make_llm(tiny_llama_dir).llm_engine
    proposer = _proposer(eng, 3, trained_heads_dir, cls=RecordingMedusa)
    eng.set_proposer(proposer)
    full = _generate_greedy(eng, prompts)
    assert eng.spec_stats.num_accepted_draft_tokens > 0  # spec rows with accepted drafts are among the observed
    seen_ids = {seq_id for seq_id, _, _ in proposer.seen}
    assert seen_ids == set(full) and len(proposer.seen) > len(prompts)
    for seq_id, n, h in proposer.seen:
        tokens = full[seq_id]
        assert len(prompts[int(seq_id[1:])]) < n <= len(tokens)
        # the newest token (index n - 1) came from the hidden state at position n - 2
        expect = final_hidden_states(hf_base, torch.tensor([tokens[: n - 1]]))[0, -1]
        torch.testing.assert_close(h, expect, rtol=1e-4, atol=1e-4)


class ProposalRecordingMedusa(MedusaProposer):
    """Keeps every (context token ids, drafts) it proposed."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.proposed: list[tuple[list[int], list[int]]] = []

    def propose(self, requests):
        out = super().propose(requests)
        self.proposed += [(r.token_ids, list(out[r.seq_id])) for r in requests if out.get(r.seq_id)]
        return out


def test_engine_drafts_are_the_training_paths_top1(tiny_llama_dir, test_prompts, hf_base, trained_heads_dir):
    """Issue 17's train/inference check: for the same text, every head's top-1 through the engine's proposer
    is its top-1 on the trainer's path (HF final normed hidden state at position t), and the label training
    gives head k at t (token t + k + 2) is the token the engine verifies that draft against."""
    prompts = test_prompts["hidden"]
    eng = _make_llm(tiny_llama_dir).llm_engine
    proposer = _proposer(eng, 3, trained_heads_dir, cls=ProposalRecordingMedusa)
    eng.set_proposer(proposer)
    full = _generate_greedy(eng, prompts)
    heads, lm_head = MedusaHeads.load(trained_heads_dir), frozen_lm_head(hf_base)
    assert len(proposer.proposed) > len(prompts)
    for context, drafts in proposer.proposed:
        text = next(t for t in full.values() if t[: len(context)] == context)
        n = len(context)
        hidden = final_hidden_states(hf_base, torch.tensor([context]))[0]  # the trainer's hidden states
        with torch.no_grad():
            expect = heads(hidden[n - 2 : n - 1], lm_head).argmax(-1)[0, : len(drafts)].tolist()
        assert drafts == expect
        flat, labels = head_targets(torch.tensor([text]), 3)
        if n - 2 in flat.tolist():
            assert labels[flat.tolist().index(n - 2)].tolist() == text[n : n + 3]


# ---------------------------------------------------------------- tree verification (medusa_tree.py)

# served with the top-1 chain first (nodes 0, 1, 2, MedusaTree's order): an accepted path through a rank-1 node ([1],
# [1, 0], [0, 1]; in "default" 9 of its 12 nodes) is not the row's leading drafts, so its KV has to move
SKEWED_TREE = [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]]


def _tree_proposer(eng, heads_dir, tree, k: int = 3) -> MedusaTreeProposer:
    config = SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": k,
                                          "model": str(heads_dir), "tree": tree})
    return MedusaProposer.from_config(config, _context(eng))


@pytest.fixture()
def kv_moves(monkeypatch):
    """Counts the KV rows the engine moved (accepted tree paths that were not the leading drafts)."""
    moved = []
    original = spec_step.move_kv_slots

    def counting(worker, src, dst):
        moved.append(len(src))
        original(worker, src, dst)

    monkeypatch.setattr(spec_step, "move_kv_slots", counting)
    return moved


@pytest.mark.parametrize("batch", [1, 2])
def test_clamped_trees_replay_the_full_trees_step_graph(tiny_llama_dir, test_prompts, trained_heads_dir, batch,
                                                         monkeypatch):
    """A request's last drafts are clamped to a prefix of its tree (max_tokens); the step is padded back to the full
    trees' tokens (tree_step.pad_tree_step) and replays their step graph, every replay checked against the eager
    forward bit for bit: outputs equal plain decoding, and no tree step of another token count is ever run."""
    from pagellm.engine import model_runner

    monkeypatch.setenv("PAGELLM_STEP_GRAPH_CHECK", "1")
    pads = []
    monkeypatch.setattr(model_runner, "pad_tree_step", lambda *a: pads.append(a[4]) or pad_tree_step(*a))
    prompts = test_prompts[4][:batch]
    ref_llm, llm = _make_llm(tiny_llama_dir), _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _tree_proposer(eng, trained_heads_dir, SKEWED_TREE)
    eng.set_proposer(proposer)
    graphs, full = eng.runner.step_graphs, batch * (1 + len(SKEWED_TREE))
    for max_tokens in (9, 6, 7, 5, 8):  # answers of several lengths: their last trees clamped to each prefix
        params = _greedy(max_tokens)
        assert [o.token_ids for o in _generate(llm, prompts, params)] == \
            [o.token_ids for o in _generate(ref_llm, prompts, params)]
    assert graphs.check and pads and max(pads) >= 3
    tree_keys = {key for key in graphs._seen if key[0] == "tree"}
    assert {key[2] for key in tree_keys} <= {full} | {1 + len(SKEWED_TREE)}, tree_keys  # (batch 2: one row left)
    if batch == 1:  # (two rows: too few steps of one padded layout to reach a capture)
        assert sum(n for key, n in graphs.num_replays_by_key.items() if key[0] == "tree") > 0
    _assert_all_blocks_free(eng)


@pytest.mark.parametrize("batch,tree", [(1, SKEWED_TREE), (4, "default")])
def test_greedy_tree_medusa_matches_plain_decoding(tiny_llama_dir, test_prompts, trained_heads_dir, kv_moves,
                                                   batch, tree):
    kw = dict(block_size=4, num_kv_blocks=64, enable_prefix_caching=True)
    prompts = test_prompts[batch]
    params = _greedy(logprobs=2)
    ref_llm, llm = _make_llm(tiny_llama_dir, **kw), _make_llm(tiny_llama_dir, **kw)
    ref = _generate(ref_llm, prompts, params)
    eng = llm.llm_engine
    proposer = _tree_proposer(eng, trained_heads_dir, tree)
    eng.set_proposer(proposer)
    outs = _generate(llm, prompts, params)
    # second round: prompts that extend the first outputs reuse cached blocks holding moved tree-path KV
    again = [p + list(o.token_ids[:12]) for p, o in zip(prompts, ref)]
    ref, outs = ref + _generate(ref_llm, again, params), outs + _generate(llm, again, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # every later token's logprobs come from logits over the moved KV: they match a plain decode's
    for out, expect in zip(outs, ref):
        for got_pos, ref_pos in zip(out.logprobs, expect.logprobs):
            assert got_pos.keys() == ref_pos.keys()
            for tok, lp in ref_pos.items():
                assert got_pos[tok].logprob == pytest.approx(lp.logprob, abs=1e-4)
    stats = eng.spec_stats
    assert stats.num_proposer_errors == 0 and 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens, stats
    assert sum(kv_moves) > 0  # some accepted paths leave the top-1 chain
    assert eng.scheduler.prefix_cache_hits > 0
    _assert_all_blocks_free(eng)
    assert proposer.num_tracked_seqs == 0


def test_sampled_rows_keep_chains_and_blocks_come_back(tiny_llama_dir, test_prompts, trained_heads_dir):
    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _tree_proposer(eng, trained_heads_dir, "default")
    eng.set_proposer(proposer)
    seen_trees = []
    original = proposer.propose

    def recording(requests):
        out = original(requests)
        seen_trees.append(set(proposer._tree_rows))
        return out

    proposer.propose = recording
    prompts = test_prompts[4][:2]
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True), _greedy()]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [MAX_TOKENS] * 2
    trees = set().union(*seen_trees)
    assert trees and all(sid.startswith(outs[1].request_id) for sid in trees)  # only the greedy request's
    assert eng.spec_stats.num_proposer_errors == 0
    _assert_all_blocks_free(eng)


def test_tree_deeper_than_the_heads_raises(tiny_llama_dir, trained_heads_dir):
    eng = _make_llm(tiny_llama_dir).llm_engine
    with pytest.raises(ValueError, match="needs num_speculative_tokens >= 4"):
        _tree_proposer(eng, trained_heads_dir, [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], k=3)
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        _tree_proposer(eng, trained_heads_dir, "mc_sim_7b_63", k=4)


# ---------------------------------------------------------------- bad input


def test_bad_configurations_raise(tmp_path, tiny_llama_dir, vocab):
    assert "medusa" in list_proposers()
    eng = _make_llm(tiny_llama_dir).llm_engine
    MedusaHeads(HIDDEN // 2, vocab).save(tmp_path / "narrow")
    with pytest.raises(ValueError, match="hidden_size 32"):
        _proposer(eng, 2, tmp_path / "narrow")
    MedusaHeads(HIDDEN, vocab + 1).save(tmp_path / "wide")
    with pytest.raises(ValueError, match="vocab_size"):
        _proposer(eng, 2, tmp_path / "wide")
    MedusaHeads(HIDDEN, vocab, num_heads=2).save(tmp_path / "two")
    with pytest.raises(ValueError, match="exceeds the 2 Medusa heads"):
        _proposer(eng, 3, tmp_path / "two")
    with pytest.raises(ValueError, match="not found"):
        _proposer(eng, 1, tmp_path / "missing")
    with pytest.raises(ValueError, match="needs model="):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_heads must be an integer"):
        MedusaHeads(HIDDEN, vocab, num_heads=0)
    with pytest.raises(ValueError, match="need the target's lm_head"):
        MedusaHeads(HIDDEN, vocab)(torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match="share the target's LM head: pass lm_head"):
        MedusaProposer(1, MedusaHeads(HIDDEN, vocab))
    with pytest.raises(ValueError, match="must be one of"):
        MedusaTrainConfig(data="web").check()


def test_sampled_n2_children_get_hidden_states_and_blocks_come_back(tiny_llama_dir, test_prompts, trained_heads_dir):
    from pagellm import SamplingParams

    llm = _make_llm(tiny_llama_dir)
    eng = llm.llm_engine
    proposer = _proposer(eng, 2, trained_heads_dir, cls=RecordingMedusa)
    eng.set_proposer(proposer)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in test_prompts[4][:2]], params, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [MAX_TOKENS] * 4
    assert eng.spec_stats.num_proposer_errors == 0 and eng.spec_stats.num_draft_tokens > 0
    assert len({seq_id for seq_id, _, _ in proposer.seen}) == 4  # both children of both requests
    _assert_all_blocks_free(eng)
    assert proposer.num_tracked_seqs == 0


def test_lm_head_from_the_checkpoint_matches_the_targets(tiny_llama_dir):
    from pagellm.spec_decode.medusa import target_lm_head

    eng = _make_llm(tiny_llama_dir).llm_engine
    x = torch.randn(4, HIDDEN)
    in_process = target_lm_head(_context(eng))
    from_files = target_lm_head(ProposerContext(eng.config, eng.model_files, eng.tokenizer, eng.vocab_size, None))
    torch.testing.assert_close(in_process(x), eng.model.compute_logits(x))
    torch.testing.assert_close(from_files(x), eng.model.compute_logits(x))
