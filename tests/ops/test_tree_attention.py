"""paged_tree_attention (Medusa tree verification) against the pure-torch reference and the prefill op."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagellm import ops
from pagellm.ops import reference as ref
from ops.op_helpers import assert_close, poison, random_block_tables, random_caches, requires_ops, strided_heads

pytestmark = requires_ops


def random_parents(num_nodes: int, seed: int) -> list[int]:
    """A random tree in topological order: each node's parent is -1 (a root) or an earlier node."""
    rng = random.Random(seed)
    return [rng.randrange(-1, j) if j else -1 for j in range(num_nodes)]


def medusa_parents(branching=(1, 10, 4, 3, 2, 2), num_nodes=64) -> list[int]:
    """A Medusa-style tree: one root (the verified token), then level d gives each node branching[d] children,
    breadth first, truncated to num_nodes (64 = the root + 63 candidates, like Medusa's 63-choice trees)."""
    parents, level = [-1], [0]
    for fan in branching[1:]:
        nxt = []
        for p in level:
            for _ in range(fan):
                if len(parents) == num_nodes:
                    return parents
                parents.append(p)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def _batch(trees, device, pad_value=True):
    """trees: list of (context_len, parents). Returns seq_lens, query_start_loc (int32) and the tree mask
    [num_tokens, max_T]; columns past a sequence's tree are filled with pad_value (they must be ignored)."""
    sizes = [len(p) for _, p in trees]
    width = max(max(sizes, default=1), 1) + 2
    mask = torch.full((sum(sizes), width), pad_value, dtype=torch.bool)
    row = 0
    for _, parents in trees:
        n = len(parents)
        if n:
            mask[row : row + n, :n] = ops.tree_mask_from_parents(parents)
        row += n
    qsl = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for (c, _), n in zip(trees, sizes)], dtype=torch.int32)
    return seq_lens.to(device), qsl.to(device), mask.to(device)


def _tree_case(device, trees, num_heads, num_kv_heads, head_dim, block_size, dtype, softcap=0.0, seed=0):
    """Runs the op and the reference on one batch; returns (out, expected, args) for further checks."""
    seq_lens, qsl, mask = _batch(trees, device)
    tables, num_blocks = random_block_tables(seq_lens.tolist(), block_size, seed=seed)
    kc, vc = random_caches(num_blocks, num_kv_heads, block_size, head_dim, dtype, device, seed=seed + head_dim)
    query = strided_heads(int(qsl[-1]), num_heads, head_dim, dtype, device, seed=seed + 1)
    args = (kc, vc, tables.to(device), qsl, seq_lens, mask, 1.0 / math.sqrt(head_dim), softcap)
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    ops.paged_tree_attention(out, query, *args)
    ref.paged_tree_attention(expected, query, *args)
    return out, expected, query, args


# (context_len, number of tree nodes or "medusa"); block sizes below put contexts on, before and after boundaries.
_TREES = {
    "single": [(37, 6)],
    "no_context": [(0, 9)],
    "batch": [(16, 7), (0, 3), (33, 12), (15, 1)],  # exactly a block, none, crossing, one-node tree
    "medusa": [(100, "medusa"), (31, "medusa")],
}


def _trees(name, seed):
    specs = enumerate(_TREES[name])
    return [(c, medusa_parents() if n == "medusa" else random_parents(n, seed + i)) for i, (c, n) in specs]


@pytest.mark.parametrize(
    "trees,num_heads,num_kv_heads,head_dim,block_size,dtype",
    [
        ("single", 4, 4, 64, 16, torch.float32),  # MHA
        ("no_context", 8, 2, 80, 16, torch.bfloat16),  # GQA 4, odd head dim, tree only
        ("batch", 8, 4, 96, 16, torch.float32),  # GQA 2, ragged batch of different trees
        ("batch", 14, 2, 112, 8, torch.float16),  # GQA 7
        ("batch", 16, 2, 128, 1, torch.bfloat16),  # GQA 8, block_size 1
        ("medusa", 8, 1, 256, 32, torch.float32),  # MQA, 64-node Medusa trees
        ("medusa", 32, 8, 128, 16, torch.bfloat16),  # Llama-like
    ],
)
def test_tree_attention_matches_reference(device, trees, num_heads, num_kv_heads, head_dim, block_size, dtype):
    for seed in (0, 1):
        out, expected, _, _ = _tree_case(device, _trees(trees, seed), num_heads, num_kv_heads, head_dim, block_size,
                                         dtype, seed=seed)
        assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_softcap(device, dtype):
    out, expected, _, _ = _tree_case(device, _trees("batch", 3), 8, 2, 64, 16, dtype, softcap=5.0, seed=3)
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_tree_equals_prefill(device, dtype):
    """A chain (each node's parent the previous one) is causal attention: the prefill op on the same tokens."""
    trees = [(c, [-1] + list(range(n - 1))) for c, n in ((40, 5), (0, 8), (16, 16), (3, 1))]
    out, _, query, args = _tree_case(device, trees, 8, 2, 128, 16, dtype, seed=5)
    kc, vc, tables, qsl, seq_lens, _, scale, _ = args
    prefill = poison(torch.empty_like(query))
    ops.paged_attention_prefill(prefill, query, kc, vc, tables, qsl, seq_lens, scale)
    assert_close(out, prefill)


def _decode_over(query_row, kc, vc, table, positions, block_size, scale, device, softcap=0.0):
    """paged_attention_decode of one query [1, H, D] over the cache rows at `positions` (in that order), gathered
    into fresh consecutive blocks of 16: what a plain decode sees once those keys are the sequence's context."""
    L, fresh = len(positions), 16
    num_blocks = (L + fresh - 1) // fresh

    def blocks(c):  # [num_blocks, H, 16, D]
        rows = torch.stack([c[table[p // block_size].long(), :, p % block_size] for p in positions])  # [L, H, D]
        rows = torch.cat([rows, rows.new_zeros(num_blocks * fresh - L, *rows.shape[1:])])
        return rows.view(num_blocks, fresh, *rows.shape[1:]).transpose(1, 2).contiguous()

    out = torch.empty_like(query_row)
    ops.paged_attention_decode(out, query_row.contiguous(), blocks(kc), blocks(vc),
                               torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
                               torch.tensor([L], dtype=torch.int32, device=device), scale, softcap=softcap)
    return out


@pytest.mark.parametrize("dtype,context", [(torch.float32, 21), (torch.bfloat16, 21), (torch.bfloat16, 254),
                                           (torch.bfloat16, 600)])
def test_each_node_is_a_plain_decode_of_its_path(device, dtype, context):
    """Node j's output is, bit for bit, the decode op's over a sequence whose context is the committed one followed
    by the path root..j (same K/V rows, gathered into a fresh chain): a bf16 Medusa tree step then decodes exactly
    like plain decoding. Contexts: short, a path crossing the decode kernel's 256-key partition, several partitions."""
    if device != "cpu":
        pytest.skip("bit-identity with the decode kernel is the CPU kernel's contract (CUDA: close to the reference)")
    parents, H, KV, D, bs = random_parents(10, seed=7), 8, 2, 64, 8
    out, expected, query, args = _tree_case(device, [(context, parents)], H, KV, D, bs, dtype, seed=7)
    assert_close(out, expected)
    kc, vc, tables, _, _, _, scale, _ = args
    ancestors = ops.tree_mask_from_parents(parents)
    for j in range(len(parents)):
        path = [context + i for i in range(len(parents)) if ancestors[j, i]]
        alone = _decode_over(query[j : j + 1], kc, vc, tables[0], list(range(context)) + path, bs, scale, device)
        assert torch.equal(out[j : j + 1], alone), f"node {j}"


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", [
    (torch.bfloat16, 9, 3, 64, 16),  # the default model's attention (3 queries per kv head)
    (torch.float32, 6, 2, 80, 8),
    (torch.float16, 7, 1, 48, 1),  # MQA, group 7: trees past 6 tokens take several fused chunks
    (torch.bfloat16, 4, 4, 112, 32),
])
@pytest.mark.parametrize("context,num_nodes", [(0, 7), (31, 5), (32, 7), (33, 16), (250, 9), (257, 3), (511, 20)])
def test_tree_tokens_fused_over_the_context_are_plain_decodes(device, dtype, num_heads, num_kv_heads, head_dim,
                                                               block_size, context, num_nodes):
    """The tokens of one tree share a pass over their common context (tree_runs_cpu_kernels.h), and each still gets
    its path's plain decode bits: contexts none, within, at and past a key tile (32) and the 256-key partition, trees
    larger than one fused chunk (48 heads), odd head dims, block sizes 1-32, and a softcap."""
    if device != "cpu":
        pytest.skip("bit-identity with the decode kernel is the CPU kernel's contract (CUDA: close to the reference)")
    softcap = 7.5 if context == 33 else 0.0
    seed = context + num_nodes
    parents = [-1] + [p + 1 for p in random_parents(num_nodes - 1, seed=seed)]  # a root, as a verify row has
    out, expected, query, args = _tree_case(device, [(context, parents)], num_heads, num_kv_heads, head_dim,
                                            block_size, dtype, softcap=softcap, seed=seed)
    assert_close(out, expected)
    kc, vc, tables, _, _, _, scale, _ = args
    ancestors = ops.tree_mask_from_parents(parents)
    for j in range(num_nodes):
        path = [context + i for i in range(num_nodes) if ancestors[j, i]]
        alone = _decode_over(query[j : j + 1], kc, vc, tables[0], list(range(context)) + path, block_size, scale,
                             device, softcap)
        assert torch.equal(out[j : j + 1], alone), f"node {j}"


def test_mixed_batch_rows_take_the_plain_steps_kernels(device):
    """In one call: a long chain (a prefill chunk) gets the prefill op's bits, a short chain and one-token rows the
    decode op's per token, a tree its paths' decodes; and all of it matches the reference."""
    if device != "cpu":
        pytest.skip("bit-identity with the decode / prefill kernels is the CPU kernel's contract")
    chain = lambda n: [-1] + list(range(n - 1))  # noqa: E731
    trees = [(5, [-1]), (70, chain(40)), (300, random_parents(12, seed=3)), (17, chain(6)), (0, chain(1))]
    H, KV, D, bs, dtype = 8, 2, 64, 16, torch.bfloat16
    out, expected, query, args = _tree_case(device, trees, H, KV, D, bs, dtype, seed=11)
    assert_close(out, expected)
    kc, vc, tables, qsl, seq_lens, mask, scale, _ = args
    prefill = torch.empty_like(query[1:41])
    ops.paged_attention_prefill(prefill, query[1:41].contiguous(), kc, vc, tables[1:2].contiguous(),
                                torch.tensor([0, 40], dtype=torch.int32), seq_lens[1:2].contiguous(), scale)
    assert torch.equal(out[1:41], prefill)
    for s, t0 in ((0, 0), (2, 41), (3, 53), (4, 59)):
        context = int(seq_lens[s]) - (int(qsl[s + 1]) - t0)
        for t in range(t0, int(qsl[s + 1])):
            path = [context + i for i in range(int(qsl[s + 1]) - t0) if mask[t, i]]
            alone = _decode_over(query[t : t + 1], kc, vc, tables[s], list(range(context)) + path, bs, scale, device)
            assert torch.equal(out[t : t + 1], alone), f"sequence {s} token {t}"


def test_chain_rows_split_like_the_cpu_backend(device):
    """A chain of up to MULTI_QUERY_MAX_LEN tokens attends like the cpu backend's multi-query decode (one decode per
    token), a longer one like its prefill call: the kernel's split matches attention/cpu_backend.py's."""
    if device != "cpu":
        pytest.skip("the split between the decode and prefill kernels is the CPU kernel's")
    from pagellm.attention.cpu_backend import MULTI_QUERY_MAX_LEN

    n = MULTI_QUERY_MAX_LEN
    trees = [(50, [-1] + list(range(n - 1))), (50, [-1] + list(range(n)))]
    out, _, query, args = _tree_case(device, trees, 8, 2, 64, 16, torch.bfloat16, seed=13)
    kc, vc, tables, qsl, seq_lens, _, scale, _ = args
    for t in range(n):  # the short chain: token t is a decode of 50 + t + 1 keys
        alone = _decode_over(query[t : t + 1], kc, vc, tables[0], list(range(51 + t)), 16, scale, device)
        assert torch.equal(out[t : t + 1], alone), f"token {t}"
    prefill = torch.empty_like(query[n:])
    ops.paged_attention_prefill(prefill, query[n:].contiguous(), kc, vc, tables[1:2].contiguous(),
                                torch.tensor([0, n + 1], dtype=torch.int32), seq_lens[1:2].contiguous(), scale)
    assert torch.equal(out[n:], prefill)


def test_empty_row_and_empty_sequence(device):
    """A token that sees nothing (no context, empty mask row) gets zeros; a sequence without tree tokens is fine."""
    seq_lens, qsl, mask = _batch([(0, [-1, 0]), (5, [])], device, pad_value=False)
    mask[0, 0] = False  # token 0 sees nothing
    tables, nb = random_block_tables(seq_lens.tolist(), 4)
    kc, vc = random_caches(nb, 2, 4, 64, torch.float32, device)
    query = torch.randn(2, 2, 64, device=device)
    out, expected = poison(torch.empty_like(query)), torch.empty_like(query)
    args = (kc, vc, tables.to(device), qsl, seq_lens, mask, 0.125)
    ops.paged_tree_attention(out, query, *args)
    ref.paged_tree_attention(expected, query, *args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close(out, expected)


def test_tree_helpers():
    assert ops.tree_depths([-1, 0, 0, 1, -1, 4]) == [0, 1, 1, 2, 0, 1]
    mask = ops.tree_mask_from_parents([-1, 0, 0, 1])
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [True, False, True, False], [True, True, False, True]]
    assert len(medusa_parents()) == 64
    with pytest.raises(ValueError, match="parents\\[1\\]"):
        ops.tree_mask_from_parents([-1, 1])


def test_bad_inputs():
    seq_lens, qsl, mask = _batch([(5, [-1, 0, 0])], "cpu")
    tables, nb = random_block_tables(seq_lens.tolist(), 4)
    kc, vc = random_caches(nb, 2, 4, 64, torch.float32, "cpu")
    q = torch.randn(3, 4, 64)
    out = torch.empty_like(q)
    with pytest.raises(TypeError, match="tree_mask must be bool or uint8"):
        ops.paged_tree_attention(out, q, kc, vc, tables, qsl, seq_lens, mask.float(), 0.1)
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        ops.paged_tree_attention(out, q, kc, vc, tables, qsl, seq_lens, mask[:2], 0.1)
    with pytest.raises(TypeError, match="query_start_loc"):
        ops.paged_tree_attention(out, q, kc, vc, tables, qsl.long(), seq_lens, mask, 0.1)
    op = torch.ops.pagellm.paged_tree_attention
    with pytest.raises(RuntimeError, match="tree_mask has 2 columns"):
        op(out, q, kc, vc, tables, qsl, seq_lens, mask[:, :2].contiguous(), 0.1)
    with pytest.raises(RuntimeError, match="tree_mask must be bool or uint8"):
        op(out, q, kc, vc, tables, qsl, seq_lens, mask.int(), 0.1)
    with pytest.raises(RuntimeError, match="seq_lens\\[0\\]"):
        op(out, q, kc, vc, tables, qsl, torch.tensor([2], dtype=torch.int32), mask, 0.1)
    with pytest.raises(RuntimeError, match="softcap"):
        op(out, q, kc, vc, tables, qsl, seq_lens, mask, 0.1, -1.0)
