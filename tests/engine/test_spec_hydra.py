"""Hydra heads (spec_decode/hydra_heads.py): the forward against a hand-written pure-torch reference on odd sizes
(teacher-forced logits, the greedy sequential chain, a tree whose nodes follow their parents), the files (a Medusa
directory still loads, the two kinds refuse each other's loader), bad input refused, and in the engine on a tiny
random Llama (fp32): greedy outputs with Hydra chains and trees token-identical to plain decoding, every block back."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.nn import functional as F

from pagellm.spec_decode.hydra_heads import HydraHeads, load_draft_heads, tree_plan
from pagellm.spec_decode.medusa import MedusaTreeProposer
from pagellm.spec_decode.medusa_heads import CONFIG_NAME, MedusaHeads, draft_vocab_lm_head
from pagellm.spec_decode.medusa_tree import MedusaTree
from pagellm.spec_decode.medusa_train import (LR_FLOOR, MedusaTrainConfig, head_inputs, head_targets, init_heads_from,
                                               lr_factor, medusa_loss, stored_draft_vocab, train_heads)

H, V, K, LAYERS = 37, 53, 3, 2  # odd sizes


def _random_hydra(num_layers: int = LAYERS, seed: int = 0, hidden: int = H, vocab: int = V) -> HydraHeads:
    gen = torch.Generator().manual_seed(seed)
    heads = HydraHeads(hidden, vocab, num_heads=K, num_layers=num_layers)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    heads.set_embedding(torch.randn(vocab, hidden, generator=gen))
    return heads


def _reference_state(heads: HydraHeads, i: int, z: torch.Tensor, tokens: torch.Tensor,
                     draft: bool = False) -> torch.Tensor:
    """Head i by hand: the token block's weight split into its z and embedding halves, then plain ResBlocks.
    `draft`: as drafting computes it, each product's operands (weights, bias, state) and result rounded to bf16
    (fp32 sums inside); the SiLU and the state's sum in fp32."""
    r = (lambda t: t.to(torch.bfloat16).float()) if draft else (lambda t: t)
    w, b = r(heads.hydra_head[i][0].linear.weight), r(heads.hydra_head[i][0].linear.bias)
    e = heads.embed_weight[tokens].float()
    z = z + F.silu(r(r(z) @ w[:, :H].t() + e @ w[:, H:].t() + b))
    for block in list(heads.hydra_head[i])[1:]:
        z = z + F.silu(r(r(z) @ r(block.linear.weight).t() + r(block.linear.bias)))
    return z


DRAFT_TOL = {"rtol": 1e-2, "atol": 2e-3}  # a bf16 product's result may round one ulp apart (another sum order)


def test_teacher_forced_logits_match_the_reference():
    heads, lm = _random_hydra(), torch.randn(V, H)
    hidden, inputs = torch.randn(5, H), torch.randint(0, V, (5, K))
    got = heads.teacher_forced(hidden, inputs, lambda x: x @ lm.t())
    z, expect = hidden, []
    for i in range(K):
        z = _reference_state(heads, i, z, inputs[:, i])
        expect.append(z @ lm.t())
    torch.testing.assert_close(got, torch.stack(expect, 1), rtol=1e-4, atol=1e-3)  # logits of size ~10-100
    assert got.shape == (5, K, V)


def test_draft_chain_feeds_each_head_the_previous_draft():
    heads, lm = _random_hydra(), torch.randn(V, H)
    vocab = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:29].tolist()))
    hidden, last = torch.randn(4, H), torch.randint(0, V, (4,))
    got = heads.draft_chain(hidden, last, lambda x: x @ lm[vocab].t(), to_token_ids=lambda i: vocab[i])
    for row in range(4):
        z, tok = hidden[row : row + 1], last[row : row + 1]
        for i in range(K):
            z = _reference_state(heads, i, z, tok, draft=True)
            tok = vocab[(z @ lm[vocab].t()).argmax(-1)]
            assert int(got[row, i]) == int(tok)
    # teacher forcing (fp32 products) with the drafts as the text gives the same argmaxes on these tie-free inputs:
    # train and serve are one computation up to the drafting products' bf16 operands
    teacher = heads.teacher_forced(hidden, torch.cat([last[:, None], got[:, :-1]], 1), lambda x: x @ lm[vocab].t())
    assert torch.equal(vocab[teacher.argmax(-1)], got)


def test_draft_tree_nodes_are_their_parents_top_k():
    heads, lm = _random_hydra(), torch.randn(V, H)
    parents, ranks = (-1, -1, -1, 0, 0, 1, 3, 3), (0, 1, 2, 0, 1, 0, 0, 1)  # depth 3
    hidden, last = torch.randn(3, H), torch.randint(0, V, (3,))
    got = heads.draft_tree(hidden, last, parents, ranks, lambda x: x @ lm.t())
    for row in range(3):
        root = _reference_state(heads, 0, hidden[row : row + 1], last[row : row + 1], draft=True)
        states, depth, tokens = {-1: root}, {-1: -1}, []
        for j, (p, r) in enumerate(zip(parents, ranks)):
            tok = (states[p] @ lm.t()).topk(r + 1, dim=-1).indices[:, r]
            tokens.append(int(tok))
            depth[j] = depth[p] + 1
            if depth[j] + 1 < K:
                states[j] = _reference_state(heads, depth[j] + 1, states[p], tok, draft=True)
        assert got[row].tolist() == tokens
    # the tree's first-rank path is the greedy chain
    chain = heads.draft_chain(hidden, last, lambda x: x @ lm.t())
    assert torch.equal(got[:, [0, 3, 6]], chain)


def test_tree_plan_levels():
    """Levels grow the nodes that have children; a level's inputs name their parents' guesses by (group, rank)."""
    plan = tree_plan((-1, -1, -1, 0, 0, 1, 3, 3), (0, 1, 2, 0, 1, 0, 0, 1))
    assert plan.depth == 3 and plan.max_rank == 3
    assert plan.grown == ((-1,), (0, 1), (3,))
    assert plan.input_tokens[1][0].tolist() == [0, 0] and plan.input_tokens[1][1].tolist() == [0, 1]
    assert plan.state_groups[1].tolist() == [0, 0]  # nodes 0 and 1 both grow from the root state
    assert plan.state_groups[2].tolist() == [0]  # node 3 from node 0, the first of level 1
    assert plan.node_tokens[0].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]  # the guessing group over all levels
    with pytest.raises(ValueError, match="must come before it"):
        tree_plan((-1, 2, 0), (0, 0, 0))
    with pytest.raises(ValueError, match="non-empty"):
        tree_plan((), ())


@pytest.mark.parametrize("paths", [[[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]],
                                   [[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0], [1, 1, 1]]])
def test_drafting_replays_from_step_graphs(paths):
    """Hydra proposers with a draft vocabulary draft from a step graph per (kind, batch size): the same tree and chain
    tokens as the eager draft_tree / draft_chain, bit for bit, for every batch size and input (odd sizes, a level whose
    parents are not all of the previous level's grown nodes)."""
    heads = _random_hydra(hidden=H, vocab=V)
    heads.set_draft_vocab(torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 40, 44, 47, 52]))
    lm = draft_vocab_lm_head(torch.randn(V, H), heads.draft_vocab)
    proposer = MedusaTreeProposer(heads, MedusaTree.from_spec(paths), lm)
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for batch in (1, 1, 1, 3, 3, 3, 2):  # per batch size: eager, captured, replayed
            hidden, last = torch.randn(batch, H, generator=gen), torch.randint(0, V, (batch,), generator=gen)
            got = proposer._draft_tree(hidden, last).clone()
            expect = heads.draft_tree(hidden, last, proposer.tree.parents, proposer.tree.ranks, lm,
                                      proposer._token_ids)
            assert torch.equal(got, expect)
            assert set(got.flatten().tolist()) <= set(heads.draft_vocab.tolist())
            chain = proposer._draft_chain(hidden, last, K).clone()
            assert torch.equal(chain, heads.draft_chain(hidden, last, lm, K, proposer._token_ids))
    graphs = proposer._graphs
    assert graphs.num_graphs == 4 and graphs.num_replays == 4  # trees and chains at batch 1 and 3
    # without a draft vocabulary (the target's LM head, any callable) drafting stays eager
    plain = _random_hydra()
    eager = MedusaTreeProposer(plain, MedusaTree.from_spec(paths), lambda x: x @ torch.randn(V, H).t())
    assert eager._graphs is False


def test_warm_caches_names_what_replayed_drafting_reads():
    """warm_caches hands the thread pool every byte replayed drafting reads whole, in drafting's order (head 0's bf16
    products, the draft vocabulary's int8 rows and scales, the other heads, the token ids), and the pool's idle workers
    prefetch all of it when there are two threads; the drafts do not change. Eager proposers name nothing."""
    from pagellm import _C

    heads = _random_hydra(hidden=H, vocab=V)
    heads.set_draft_vocab(torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 40, 44, 47, 52]))
    lm = draft_vocab_lm_head(torch.randn(V, H), heads.draft_vocab)
    proposer = MedusaTreeProposer(heads, MedusaTree.from_spec([[0], [1], [0, 0], [0, 0, 0]]), lm)
    assert not proposer.warm_heads  # speculative_config "warm_heads" turns it on
    proposer.warm_heads = True
    proposer.warm_caches()  # before the first draft: nothing named yet, nothing happens
    assert proposer._warm_ranges == []
    hidden, last = torch.randn(1, H), torch.tensor([7])
    with torch.inference_mode():
        expect = heads.draft_tree(hidden, last, proposer.tree.parents, proposer.tree.ranks, lm, proposer._token_ids)
        proposer._draft_tree(hidden, last)
    per_head = heads.drafting_weights()
    order = [*per_head[0], lm.qweight, lm.scale, *per_head[1], *per_head[2], heads.draft_vocab]
    assert proposer._warm_ranges == [(t.data_ptr(), t.numel() * t.element_size()) for t in order]
    assert [t.dtype for t in per_head[0]] == [torch.bfloat16] * 2 * LAYERS
    saved = _C.thread_pool_info()
    try:
        _C.configure_thread_pool(2, bind=False)
        out, x, w = torch.empty(1, 2048), torch.randn(1, 1024), torch.randn(2048, 1024)
        torch.ops.pagellm.linear_small_m(out, x, w, None)  # a region on both threads: the worker is up
        before = _C.thread_pool_info()["warmed_bytes"]
        proposer.warm_caches()
        total = sum(n for _, n in proposer._warm_ranges)
        for _ in range(2000):
            if _C.thread_pool_info()["warmed_bytes"] - before >= total:
                break
            time.sleep(0.001)
        assert _C.thread_pool_info()["warmed_bytes"] - before == total
        proposer.warm_heads = False
        proposer.warm_caches()  # off: nothing more is warmed
        time.sleep(0.01)
        assert _C.thread_pool_info()["warmed_bytes"] - before == total
        proposer.warm_heads = True
        with torch.inference_mode():
            for _ in range(3):  # eager, captured, replayed: the same tokens after warming
                proposer.warm_caches()
                assert torch.equal(proposer._draft_tree(hidden, last), expect)
    finally:
        _C.configure_thread_pool(saved["num_threads"], bind=saved["bind"])
    eager = MedusaTreeProposer(_random_hydra(), MedusaTree.from_spec([[0], [0, 0]]),
                               lambda x: x @ torch.randn(V, H).t())
    with torch.inference_mode():
        eager._draft_tree(hidden, last)
    assert eager._warm_ranges == []


def test_drafting_weights_follow_the_parameters():
    """Drafting's bf16 weight copies are remade when the parameters change in place (an optimizer step, a load):
    a training's evaluation drafts with the weights of the moment."""
    heads, lm = _random_hydra(num_layers=1), torch.randn(V, H)
    hidden, last = torch.randn(3, H), torch.randint(0, V, (3,))

    def states() -> torch.Tensor:
        return heads.step(0, hidden, last, draft=True)

    before = states()
    torch.testing.assert_close(before, _reference_state(heads, 0, hidden, last, draft=True), **DRAFT_TOL)
    with torch.no_grad():
        heads.hydra_head[0][0].linear.weight.mul_(-1.0)
        heads.hydra_head[0][0].linear.bias.add_(0.5)
    after = states()
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, _reference_state(heads, 0, hidden, last, draft=True), **DRAFT_TOL)
    other = _random_hydra(num_layers=1, seed=9)
    heads.load_state_dict(other.state_dict())
    torch.testing.assert_close(states(), _reference_state(heads, 0, hidden, last, draft=True), **DRAFT_TOL)


def test_lr_schedule_and_continued_training(tmp_path):
    """lr_factor: a linear warm-up, then 1 (constant) or a half cosine down to LR_FLOOR at the last step;
    init_from: a training starts from stored heads of the same kind and sizes, other heads are refused."""
    cosine = MedusaTrainConfig(steps=100, warmup_steps=10, lr_schedule="cosine")
    constant = MedusaTrainConfig(steps=100, warmup_steps=10)
    assert [lr_factor(s, constant) for s in (0, 9, 10, 99)] == [0.1, 1.0, 1.0, 1.0]
    got = [lr_factor(s, cosine) for s in range(100)]
    assert got[:10] == [lr_factor(s, constant) for s in range(10)]
    assert all(a >= b for a, b in zip(got[10:], got[11:])) and got[99] == pytest.approx(LR_FLOOR)
    assert got[54] == pytest.approx(LR_FLOOR + (1 - LR_FLOOR) * 0.5, abs=0.02)  # halfway down
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        MedusaTrainConfig(lr_schedule="linear").check()
    stored = _random_hydra(num_layers=1, seed=5)
    stored.set_draft_vocab(torch.arange(0, V, 2))
    stored.save(tmp_path / "stored")
    fresh = HydraHeads(H, V, num_heads=K, num_layers=1)
    fresh.set_draft_vocab(torch.arange(0, V, 2))
    init_heads_from(fresh, str(tmp_path / "stored"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), stored.state_dict().values()))
    with pytest.raises(ValueError, match="another draft vocabulary"):
        init_heads_from(HydraHeads(H, V, num_heads=K, num_layers=1), str(tmp_path / "stored"))
    # continuing on other data keeps the stored rows when the size asked is theirs (train_medusa)
    assert torch.equal(stored_draft_vocab(str(tmp_path / "stored"), (V + 1) // 2), torch.arange(0, V, 2))
    assert stored_draft_vocab(str(tmp_path / "stored"), (V + 1) // 2 + 1) is None
    with pytest.raises(ValueError, match=r"\(kind, hidden, vocab, heads, layers\)"):
        init_heads_from(HydraHeads(H, V, num_heads=K, num_layers=2), str(tmp_path / "stored"))


def test_medusa_draft_tree_is_each_heads_top_k():
    gen = torch.Generator().manual_seed(3)
    heads, lm = MedusaHeads(H, V, num_heads=K), torch.randn(V, H, generator=gen)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hidden = torch.randn(2, H, generator=gen)
    logits = heads(hidden, lambda x: x @ lm.t())
    got = heads.draft_tree(hidden, None, (-1, -1, 0, 2), (0, 1, 0, 3), lambda x: x @ lm.t())
    expect = torch.stack([logits[:, 0].topk(2).indices[:, 0], logits[:, 0].topk(2).indices[:, 1],
                          logits[:, 1].argmax(-1), logits[:, 2].topk(4).indices[:, 3]], 1)
    assert torch.equal(got, expect)


def test_fresh_hydra_heads_pass_the_hidden_state_through():
    heads = HydraHeads(H, V, num_heads=2)
    heads.set_embedding(torch.randn(V, H))
    h = torch.randn(3, H)
    torch.testing.assert_close(heads.teacher_forced(h, torch.zeros(3, 2, dtype=torch.long), lambda x: x),
                               torch.stack([h, h], 1))


# ---------------------------------------------------------------- files and refusals


def test_files_round_trip_and_either_kind_loads(tmp_path):
    heads = _random_hydra()
    heads.set_draft_vocab(torch.arange(0, V, 2))
    heads.save(tmp_path / "hydra")
    config = json.loads((tmp_path / "hydra" / CONFIG_NAME).read_text())
    assert config["head_type"] == "hydra" and config["medusa_num_layers"] == LAYERS
    loaded = load_draft_heads(tmp_path / "hydra")
    assert isinstance(loaded, HydraHeads) and torch.equal(loaded.draft_vocab, heads.draft_vocab)
    assert "hydra_head.2.0.linear.weight" in loaded.state_dict()
    assert tuple(loaded.state_dict()["hydra_head.1.0.linear.weight"].shape) == (H, 2 * H)
    for name, t in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert loaded.embed_weight is None  # the embedding is the target's: the proposer sets it
    with pytest.raises(ValueError, match="set_embedding"):
        loaded.draft_chain(torch.randn(1, H), torch.tensor([1]), lambda x: x)
    # a Medusa directory (an older one has no head_type) still loads, by either loader
    medusa = MedusaHeads(H, V, num_heads=2)
    medusa.save(tmp_path / "medusa")
    config = json.loads((tmp_path / "medusa" / CONFIG_NAME).read_text())
    del config["head_type"]
    (tmp_path / "medusa" / CONFIG_NAME).write_text(json.dumps(config))
    assert type(load_draft_heads(tmp_path / "medusa")) is MedusaHeads
    assert type(MedusaHeads.load(tmp_path / "medusa")) is MedusaHeads
    with pytest.raises(ValueError, match="holds 'hydra' heads"):
        MedusaHeads.load(tmp_path / "hydra")
    config["head_type"] = "eagle"
    (tmp_path / "medusa" / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown head_type 'eagle'"):
        load_draft_heads(tmp_path / "medusa")


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="share the target's LM head"):
        HydraHeads(H, V, share_lm_head=False)
    heads = HydraHeads(H, V, num_heads=K)
    with pytest.raises(ValueError, match=r"embedding must be \[53, 37\]"):
        heads.set_embedding(torch.randn(V, H + 1))
    heads.set_embedding(torch.randn(V, H))
    with pytest.raises(ValueError, match="the 3 tokens before their guesses"):
        heads.teacher_forced(torch.randn(2, H), torch.zeros(2, 1, dtype=torch.long), lambda x: x)
    with pytest.raises(ValueError, match="pass lm_head"):
        heads.draft_chain(torch.randn(2, H), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="4 deep"):
        heads.draft_tree(torch.randn(1, H), torch.tensor([0]), (-1, 0, 1, 2), (0, 0, 0, 0), lambda x: x)
    with pytest.raises(TypeError, match="drafted tokens"):
        heads.head_states(torch.randn(1, H))
    with pytest.raises(ValueError, match="head_type must be one of"):
        MedusaTrainConfig(head_type="eagle").check()
    with pytest.raises(ValueError, match="hydra heads share"):
        MedusaTrainConfig(head_type="hydra", share_lm_head=False).check()


def test_trainer_teaches_hydra_heads_what_follows_the_token():
    """Labels t + 2 that depend only on token t + 1 (which no hidden state shows): Hydra heads learn them,
    training lowers the loss; inputs are the tokens t + 1 .. t + K."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(5, V, (16, 20), generator=gen)
    ids[:, 1::2] = (ids[:, 0::2] * 7 + 3) % V  # every odd token follows from the one before it
    hidden = torch.randn(16, 20, H, generator=gen)
    lm = torch.randn(V, H, generator=gen)
    heads = HydraHeads(H, V, num_heads=2)
    heads.set_embedding(torch.randn(V, H, generator=gen))
    flat, labels = head_targets(ids, 2)
    inputs = head_inputs(ids, flat, 2)
    assert torch.equal(inputs[0], ids[0, 1:3]) and torch.equal(labels[0], ids[0, 2:4])
    h_flat = hidden.reshape(-1, H)[flat]
    with torch.no_grad():
        before = float(medusa_loss(heads.teacher_forced(h_flat, inputs, lambda x: x @ lm.t()), labels))
    train_heads(heads, lambda x: x @ lm.t(), hidden, ids, MedusaTrainConfig(steps=60, batch_size=128, lr=1e-2,
                                                                               eval_every=0))
    with torch.no_grad():
        after = float(medusa_loss(heads.teacher_forced(h_flat, inputs, lambda x: x @ lm.t()), labels))
    assert after < 0.7 * before, (before, after)


def test_kl_loss_against_a_reference():
    """medusa_loss with the target's logits: per head (1 - w) CE + w KL(target || head), decayed; w = 0 is the CE
    alone, w = 1 with the head equal to the target is zero; odd sizes, labels outside the vocabulary (-100)."""
    gen = torch.Generator().manual_seed(11)
    logits, target = torch.randn(13, K, V, generator=gen), torch.randn(13, K, V, generator=gen)
    labels = torch.randint(0, V, (13, K), generator=gen)
    labels[2, 1] = -100
    for w in (0.0, 0.3, 1.0):
        expect = 0.0
        for i in range(K):
            p, logq = target[:, i].softmax(-1), logits[:, i].log_softmax(-1)
            kl = float((p * (p.log() - logq)).sum(-1).mean())
            keep = labels[:, i] >= 0
            ce = float(-logq[keep].gather(1, labels[keep, i : i + 1]).mean())
            expect += 0.8**i * ((1 - w) * ce + w * kl)
        got = float(medusa_loss(logits, labels, target_logits=target, kl_weight=w))
        assert got == pytest.approx(expect, rel=1e-5), (w, got, expect)
    assert float(medusa_loss(logits, labels, target_logits=None, kl_weight=0.0)) == pytest.approx(
        float(medusa_loss(logits, labels)))
    assert float(medusa_loss(target, labels, target_logits=target, kl_weight=1.0)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="kl_weight must be in"):
        MedusaTrainConfig(kl_weight=1.5).check()


def test_trainer_kl_targets_are_the_states_that_chose_the_labels():
    """With kl_weight = 1 the heads learn only from the target's distribution at t + k + 1 (the LM head over the
    state that chose label t + k + 2); the labels are other tokens, so the heads' top-1 must come to agree with the
    argmax of those logits, not with the labels, and the KL must fall."""
    gen = torch.Generator().manual_seed(12)
    n, t, k = 12, 23, 2
    ids = torch.randint(0, V, (n, t), generator=gen)
    lm = torch.randn(V, H, generator=gen)
    # the target's state at s chooses token (ids[s] * 5 + 1) % V: a function of the token there (Hydra reads it)
    want = (ids * 5 + 1) % V
    hidden = lm[want] * 3.0  # the LM head over this state peaks at `want`
    heads = HydraHeads(H, V, num_heads=k)
    heads.set_embedding(torch.randn(V, H, generator=gen))
    wrong_labels = torch.zeros_like(ids)  # CE alone would teach token 0 everywhere
    flat, _ = head_targets(ids, k)
    inputs = head_inputs(ids, flat, k)
    h_flat = hidden.reshape(-1, H)[flat]
    target_logits = torch.stack([hidden.reshape(-1, H)[flat + i + 1] @ lm.t() for i in range(k)], dim=1)

    def kl() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            logits = heads.teacher_forced(h_flat, inputs, lambda x: x @ lm.t())
            return float(medusa_loss(logits, torch.zeros_like(flat)[:, None].expand(-1, k), target_logits=target_logits,
                                     kl_weight=1.0)), logits
    before, _ = kl()
    train_heads(heads, lambda x: x @ lm.t(), hidden, ids, MedusaTrainConfig(steps=150, batch_size=128, lr=1e-2,
                                                                               eval_every=0, kl_weight=1.0),
                label_ids=wrong_labels)
    after, logits = kl()
    assert after < 0.5 * before, (before, after)
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    assert agree > 0.8 and (logits.argmax(-1) == 0).float().mean() < 0.2, agree
def test_warm_heads_option_is_checked():
    """speculative_config "warm_heads" (MedusaProposer.warm_caches, off by default) takes a bool, refused otherwise."""
    from pagellm.spec_decode.registry import SpeculativeConfig

    base = {"method": "medusa", "num_speculative_tokens": 3, "model": "/heads"}
    assert SpeculativeConfig.from_dict({**base, "warm_heads": True}).options["warm_heads"] is True
    with pytest.raises(ValueError, match="warm_heads"):
        SpeculativeConfig.from_dict({**base, "warm_heads": "yes"})
