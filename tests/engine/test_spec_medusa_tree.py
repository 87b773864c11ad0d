"""The pieces of Medusa tree verification (spec_decode/medusa_tree.py, engine/tree_step.py, the scheduler's
set_pending_draft_tokens): tree layout, path choice, positions and masks, bad trees refused at construction.
The engine runs (token identity, moved KV, blocks) are in test_spec_medusa.py, next to the trained heads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import _greedy, _make_llm  # noqa: E402

from pagellm import ops  # noqa: E402
from pagellm.attention.base import AttentionMetadata  # noqa: E402
from pagellm.engine.tree_step import (  # noqa: E402
    choose_tree_paths,
    greedy_tree_path,
    move_kv_slots,
    pad_tree_step,
    reordered_drafts,
    tree_step_inputs,
    verify_greedy_paths,
)
from pagellm.sampling.metadata import plain_greedy_metadata  # noqa: E402
from pagellm.sampling.processors import argmax_rows  # noqa: E402
from pagellm.sampling.rejection import verify_drafts  # noqa: E402
from pagellm.spec_decode.batch import SpecRows  # noqa: E402
from pagellm.spec_decode import SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.medusa_tree import MC_SIM_7B_63, MedusaTree  # noqa: E402

# ---------------------------------------------------------------- the pieces


def test_tree_layout_and_named_trees():
    tree = MedusaTree.from_spec([[1], [0, 0], [0], [0, 1], [0, 0, 0]])
    assert tree.paths == ((0,), (0, 0), (0, 0, 0), (1,), (0, 1))  # the top-1 chain first, then (depth, path)
    assert tree.parents == (-1, 0, 1, -1, 0) and tree.depths == (0, 1, 2, 0, 1) and tree.depth == 3
    topk = torch.arange(3 * 2).reshape(1, 3, 2) + 100  # head d's rank r token: 100 + 2 d + r
    assert tree.node_tokens(topk).tolist() == [[100, 102, 104, 101, 103]]
    big = MedusaTree.from_spec("mc_sim_7b_63")
    assert big.num_nodes == len(MC_SIM_7B_63) == 63 and big.depth == 4
    assert 10 <= MedusaTree.from_spec("default").num_nodes <= 16


@pytest.mark.parametrize("spec", ["default", "mc_sim_7b_63", [[2], [1, 0], [1], [0, 1], [0], [0, 0]]])
def test_the_top1_chain_comes_first(spec):
    """Every tree keeps its top-1 chain in nodes 0, 1, ..: an accepted top-1 path is already in the row's first
    lookahead slots (no KV moved); parents still precede children, so every prefix is a tree."""
    tree = MedusaTree.from_spec(spec)
    chain = [j for j, p in enumerate(tree.paths) if not any(p)]
    assert chain == list(range(len(chain))) and len(chain) == max(len(p) for p in tree.paths if not any(p))
    assert all(p < j for j, p in enumerate(tree.parents))
    assert sorted(tree.paths) == sorted(MedusaTree.from_spec(spec).paths)
    parents = list(tree.parents)
    target = [0] * (1 + tree.num_nodes)
    drafts = [0 if j < len(chain) else 1 for j in range(tree.num_nodes)]  # the target agrees along the chain only
    assert greedy_tree_path(target, drafts, parents) == list(range(len(chain)))


def test_greedy_tree_path_and_reorder():
    parents = [-1, -1, 0, 1, 2]
    drafts = [7, 8, 9, 9, 5]
    # the target says 8 after the root, then 9 after node 1, then 4 after node 3: path = nodes 1, 3
    target = [8, 0, 9, 0, 4, 0]
    assert greedy_tree_path(target, drafts, parents) == [1, 3]
    assert greedy_tree_path([6, 0, 0, 0, 0, 0], drafts, parents) == []

    class Split:
        draft_token_ids = [drafts, [1, 2]]

    assert reordered_drafts(Split, [[1, 3], [0, 1]], [2, 1]) == [8, 9, 7, 9, 5, 1, 2]


@pytest.mark.parametrize("seed", range(8))
def test_verify_greedy_paths_equals_the_samplers_verify(seed):
    """A plain-greedy tree step verifies its chosen paths from the argmax rows that chose them: the same accepted
    tokens as the sampler's verify of the paths as chains, for trees and chains (whose drafts only the verify
    checks), bf16 logits with ties, drafts that agree with the target ~60 % of the time."""
    rng, gen, vocab = random.Random(seed), torch.Generator().manual_seed(seed), 23
    parents_per_row = []
    for _ in range(rng.randrange(1, 5)):
        k = rng.randrange(0, 10)
        tree = rng.random() < 0.6 and k > 0
        parents_per_row.append([rng.randrange(-1, j) for j in range(k)] if tree else None)
    counts = [1 + (len(p) if p is not None else rng.randrange(0, 5)) for p in parents_per_row]
    logits = (torch.randn(sum(counts), vocab, generator=gen) * 2).round().to(torch.bfloat16)  # ties too
    target = argmax_rows(logits).tolist()
    drafts, start = [], 0
    for parents, n in zip(parents_per_row, counts):
        parents = parents if parents is not None else list(range(-1, n - 2))
        drafts.append([target[start + (0 if p < 0 else 1 + p)] if rng.random() < 0.6 else rng.randrange(vocab)
                       for p in parents])
        start += n
    rows = np.arange(len(counts))
    split = SpecRows(rows[:0], rows[:0], rows, np.arange(sum(counts)), drafts)
    paths = choose_tree_paths(split, parents_per_row, target, [f"s{i}" for i in rows])
    expected = verify_drafts(logits[torch.as_tensor(paths.chain_logit_rows)], paths.chain_split.draft_token_ids,
                             plain_greedy_metadata(len(paths.chain_logit_rows), vocab))
    got = verify_greedy_paths(paths)
    assert got.accepted_token_ids == expected.accepted_token_ids
    assert got.num_accepted_tokens == expected.num_accepted_tokens and got.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_tree_step_leaves_every_real_token_alone(dtype):
    """pad_tree_step grows the last row by dummy tokens (slot -1, the row's last position, each seeing only itself):
    paged_tree_attention gives every real token the same bits as without them (a decode row, then a clamped tree
    of 3 nodes over 37 context keys, padded by 4), and a row past its block table's capacity is not padded."""
    gen, bs, kv_heads, heads, dim = torch.Generator().manual_seed(3), 8, 2, 6, 64
    parents = [-1, 0, 0]  # the clamped row: its root and two drafts under it
    lens = [20, 37 + 3]
    qsl = torch.tensor([0, 1, 4], dtype=torch.int32)
    tables = torch.randperm(16, generator=gen).to(torch.int32).view(2, 8)
    md = AttentionMetadata(num_reqs=2, num_tokens=4, num_decode_reqs=1, max_query_len=3, max_seq_len=40,
                           slot_mapping=torch.tensor([5, 9, 10, 11]), block_tables=tables,
                           seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=qsl)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[0, 0] = True
    mask[1:, :3] = ops.tree_mask_from_parents(parents)
    ids, pos = torch.arange(4), torch.tensor([19, 37, 38, 38])
    assert pad_tree_step(md, ids, pos, mask, 4, capacity=40 + 3) is None  # 44 keys do not fit
    padded, ids2, pos2, mask2 = pad_tree_step(md, ids, pos, mask, 4, capacity=64)
    assert padded.num_tokens == 8 and padded.query_start_loc.tolist() == [0, 1, 8]
    assert padded.seq_lens.tolist() == [20, 44]
    assert padded.slot_mapping.tolist() == [5, 9, 10, 11, -1, -1, -1, -1] and padded.max_query_len == 7
    assert ids2.tolist()[:4] == ids.tolist() and pos2.tolist() == [19, 37, 38, 38, 38, 38, 38, 38]
    assert torch.equal(mask2[:4, :3], mask) and not mask2[:4, 3:].any() and mask2[4:, 3:].equal(torch.eye(4) > 0)
    assert md.seq_lens.tolist() == lens and md.query_start_loc.tolist() == [0, 1, 4]  # the step's own untouched
    kc, vc = (torch.randn(16, kv_heads, bs, dim, generator=gen).to(dtype) for _ in range(2))
    query = torch.randn(8, heads, dim, generator=gen).to(dtype)
    out, out2 = torch.empty(4, heads, dim, dtype=dtype), torch.empty(8, heads, dim, dtype=dtype)
    ops.paged_tree_attention(out, query[:4], kc, vc, tables, qsl, md.seq_lens, mask, 0.125)
    ops.paged_tree_attention(out2, query, kc, vc, tables, padded.query_start_loc, padded.seq_lens, mask2, 0.125)
    assert torch.equal(out, out2[:4])


def test_tree_step_inputs_positions_and_mask():
    import numpy as np

    class Out:  # one decode row, one spec row (root + 3 drafts: parents -1, -1, 0), one 2-token prefill chunk
        query_start_loc = np.array([0, 1, 5, 7], dtype=np.int32)
        positions = np.array([9, 20, 21, 22, 23, 3, 4], dtype=np.int64)
        num_draft_tokens = np.array([0, 3, 0], dtype=np.int32)

    positions, mask = tree_step_inputs(Out, np.array([-1, -1, 0], dtype=np.int32))
    assert positions.tolist() == [9, 20, 21, 21, 22, 3, 4]
    expect = torch.zeros(7, 4, dtype=torch.bool)
    expect[0, 0] = True
    expect[1:5, :4] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    expect[5:7, :2] = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expect)


@pytest.mark.parametrize("src,dst", [
    ([37, 40], [35, 36]),  # a tree path's moves (each node to its depth's slot): row by row in place
    ([3], [17]),  # across blocks
    ([20, 21], [21, 22]),  # a source is another move's destination: the gather / scatter path
    ([5, 6], [9, 9]),  # one destination twice: the gather / scatter path (the last move wins)
])
def test_move_kv_slots_reads_every_source_before_writing(src, dst):
    """move_kv_slots against a whole-cache reference (every source row read first, then every destination written,
    later moves winning): keys, values and quantized caches' scales, in place and through the gather path."""
    block_size, gen = 16, torch.Generator().manual_seed(0)
    shape = (4, 3, block_size, 5)  # [num_blocks, num_kv_heads, block_size, head_dim]
    tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen),
               torch.randn(shape[:3], generator=gen)]  # a scale tensor: [num_blocks, num_kv_heads, block_size]

    class Caches:  # the worker's KVCaches as move_kv_slots reads it
        layer_ids = (0,)

        def __getitem__(self, layer_id):
            return type("Layer", (), {"key_cache": tensors[0]})()

        def tensors(self):
            return iter(tensors)

    worker = type("Worker", (), {"runner": type("Runner", (), {"kv_caches": Caches()})()})()
    expect = []
    for t in tensors:
        flat = t.transpose(1, 2).reshape(shape[0] * block_size, *t.shape[1:2], *t.shape[3:]).clone()  # [slots, ...]
        rows = flat[src].clone()
        for d, row in zip(dst, rows):
            flat[d] = row
        expect.append(flat)
    move_kv_slots(worker, src, dst)
    for t, e in zip(tensors, expect):
        assert torch.equal(t.transpose(1, 2).reshape(e.shape), e)


@pytest.mark.parametrize("tree,match", [
    ([], "non-empty list of paths"),
    ("nope", "unknown Medusa tree"),
    ([[0], [0]], "repeated path"),
    ([[0], [1, 0]], "no parent path"),
    ([[0], [-1]], "top-k indices >= 0"),
    ([[0], "a"], "top-k indices >= 0"),
    ([[i] for i in range(257)], "at most 256"),
])
def test_bad_trees_raise_at_construction(tree, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 3, "model": "/x", "tree": tree})


def test_set_pending_draft_tokens_checks_its_input(tiny_llama_dir):
    eng = _make_llm(tiny_llama_dir).llm_engine
    sched = eng.scheduler
    with pytest.raises(RuntimeError, match="no step is pending"):
        sched.set_pending_draft_tokens([])
    eng.set_proposer(None)
    sched.set_num_lookahead_tokens(2)
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7]}, _greedy(8))
    eng.step()  # the prompt; "a" is decode-ready now
    sched.set_draft_tokens("a", [9, 10])
    out = sched.schedule()
    assert list(out.draft_token_ids) == [9, 10]
    with pytest.raises(ValueError, match="3 draft ids, the pending step has 2"):
        sched.set_pending_draft_tokens([1, 2, 3])
    with pytest.raises(ValueError, match=">= 0"):
        sched.set_pending_draft_tokens([1, -2])
    sched.set_pending_draft_tokens([10, 9])
    with pytest.raises(ValueError, match="draft 0 was 10"):  # update() checks against the replaced drafts
        sched.update(out, [2], [9, 4], [])
    sched.update(out, [2], [10, 4], [])  # the reordered path is accepted
