"""n-gram candidate trees (`speculative_config` `tree_nodes`): the tree builder against a plain-Python reference,
the proposer's chains / trees / clamping, bad options, and end to end on a tiny random Llama: greedy output
token-identical to plain decoding (fp32 batch 1 and 8, preemption with prefix caching, bf16 without tie-free
selection), branching trees actually verified, every KV block freed."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import MIN_MARGIN, _assert_all_blocks_free, _generate, _greedy, _make_llm  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.config import EngineArgs  # noqa: E402
from pagellm.spec_decode import DraftRequest, SpeculativeConfig  # noqa: E402
from pagellm.spec_decode.ngram import NgramTreeProposer  # noqa: E402
from pagellm.spec_decode.ngram_match import find_ngram_continuation, ngram_candidate_tree  # noqa: E402
from scheduler_probes import CountingScheduler  # noqa: E402

MAX_TOKENS = 40


def _tree(k=4, nodes=10, **kw):
    return {"method": "ngram", "num_speculative_tokens": k, "tree_nodes": nodes, **kw}


# ---------------------------------------------------------------- the tree builder


def _reference_tree(tokens: list[int], min_n: int, max_n: int, depth: int, max_nodes: int):
    """The definition, by brute force: every earlier end position j of the last token with its match length
    (<= max_n) >= min_n; ranked by (length, j) descending, the best 64; each one's next `depth` tokens (read on
    cyclically); a trie whose nodes weigh the summed match lengths through them; nodes taken best-first by
    (weight desc, creation order), a node only after its parent."""
    L = len(tokens)
    matches = []
    for j in range(L - 1):
        n = 0
        while n < max_n and j - n >= 0 and tokens[j - n] == tokens[L - 1 - n]:
            n += 1
        if n >= min_n:
            matches.append((n, j))
    matches.sort(reverse=True)
    nodes: list[list] = []  # [token, parent, weight]
    for n, j in matches[:64]:
        cont = tokens[j + 1 :]
        parent = -1
        for t in (cont[i % len(cont)] for i in range(depth)):
            found = next((i for i, x in enumerate(nodes) if x[0] == t and x[1] == parent), None)
            if found is None:
                nodes.append([t, parent, 0])
                found = len(nodes) - 1
            nodes[found][2] += n
            parent = found
    picked: list[int] = []
    while len(picked) < max_nodes:
        frontier = [i for i, x in enumerate(nodes) if i not in picked and (x[1] == -1 or x[1] in picked)]
        if not frontier:
            break
        picked.append(min(frontier, key=lambda i: (-nodes[i][2], i)))
    return [nodes[i][0] for i in picked], [-1 if nodes[i][1] < 0 else picked.index(nodes[i][1]) for i in picked]


@pytest.mark.parametrize("vocab", [2, 3, 5, 40])
def test_tree_equals_reference_on_random_arrays(vocab):
    rng = random.Random(vocab)
    for _ in range(300):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 50))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 7)
        depth, nodes = rng.randrange(1, 6), rng.randrange(1, 14)
        got = ngram_candidate_tree(np.asarray(tokens, dtype=np.int64), lo, hi, depth, nodes)
        assert got == _reference_tree(tokens, lo, hi, depth, nodes), (tokens, lo, hi, depth, nodes)
        toks, parents = got
        assert all(p < j for j, p in enumerate(parents)) and len(toks) <= nodes  # parents first
        depths = [0] * len(parents)
        for j, p in enumerate(parents):
            depths[j] = 0 if p < 0 else depths[p] + 1
        assert max(depths, default=-1) < depth


def test_tree_branches_on_several_continuations_and_single_match_is_the_chain():
    seg = [5, 6, 7]
    tokens = np.asarray([1] + seg + [20, 21] + seg + [30, 31] + seg + [20, 22] + seg, dtype=np.int64)
    toks, parents = ngram_candidate_tree(tokens, 1, 4, 2, 5)
    # (5, 6, 7) was followed by 20 twice (weight 3 + 3) and by 30 once (3): the 20 branch first; then weight-3
    # nodes in the order of their occurrences (most recent first): 22 (after 20), 30, 31, and 21 (after 20)
    assert toks == [20, 22, 30, 31, 21] and parents == [-1, 0, -1, 2, 0]
    lone = np.asarray([9, 1, 2, 3, 4, 8, 1, 2], dtype=np.int64)
    assert ngram_candidate_tree(lone, 1, 4, 3, 8) == (find_ngram_continuation(lone, 1, 4, 3).tolist(), [-1, 0, 1])
    assert ngram_candidate_tree(np.asarray([1, 2, 3], dtype=np.int64), 1, 4, 3, 8) == ([], [])


def test_tree_proposer_trees_for_allowed_rows_chains_for_others_and_clamps():
    proposer = NgramTreeProposer(2, tree_nodes=5)
    seg = [5, 6, 7]
    branchy = [1] + seg + [20, 21] + seg + [30, 31] + seg + [20, 22] + seg
    reqs = [DraftRequest("t", branchy, [], max_num_drafts=5), DraftRequest("c", branchy, [], max_num_drafts=5),
            DraftRequest("small", branchy, [], max_num_drafts=2)]
    proposer.set_tree_seq_ids(["t", "small"])
    drafts = proposer.propose(reqs)
    assert drafts["t"] == [20, 22, 30, 31, 21] and proposer.draft_parents("t", 5) == [-1, 0, -1, 2, 0]
    assert proposer.draft_parents("t", 3) == [-1, 0, -1]  # the scheduler kept a prefix: still a tree
    assert drafts["c"] == [20, 22] and proposer.draft_parents("c", 2) is None  # the chain of plain ngram
    assert drafts["small"] == [20, 22] and proposer.draft_parents("small", 2) is None  # 2 nodes: a chain
    assert proposer.num_speculative_tokens == 5 and proposer.depth == 2


@pytest.mark.parametrize("config, match", [
    (_tree(4, 0), "tree_nodes"),
    (_tree(4, 257), "tree_nodes"),
    (_tree(4, "8"), "tree_nodes"),
    (_tree(4, True), "tree_nodes"),
    (_tree(4, 3.0), "tree_nodes"),
])
def test_bad_tree_nodes_raise_before_loading(tiny_llama_dir, config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(tiny_llama_dir), speculative_config=config)
    with pytest.raises(ValueError, match=match):
        LLM("/nonexistent/model/dir", speculative_config=config)


def test_fewer_tree_nodes_than_depth_raise(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"tree_nodes \(3\) must be >= num_speculative_tokens \(4\)"):
        _make_llm(tiny_llama_dir, speculative_config=_tree(4, 3))
    with pytest.raises(ValueError, match="tree_nodes"):
        NgramTreeProposer(4, tree_nodes=2)


def test_quantized_kv_cache_is_refused_at_construction(tiny_llama_dir):
    with pytest.raises(ValueError, match="ngram trees are verified with paged_tree_attention.*drop 'tree_nodes'"):
        _make_llm(tiny_llama_dir, kv_cache_dtype="int8", speculative_config=_tree())


# ---------------------------------------------------------------- end to end on the tiny model


@pytest.fixture(scope="module")
def vocab(tiny_tokenizer):
    return len(tiny_tokenizer)


def _branchy_prompts(vocab: int, num: int, seed: int) -> list[list[int]]:
    """Prompts where a segment recurs with different continuations (so the suffix has several earlier
    matches: branching trees), some plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        if i % 4 == 3:
            prompts.append([rng.randrange(5, vocab) for _ in range(rng.randrange(4, 30))])
            continue
        seg = [rng.randrange(5, vocab) for _ in range(rng.randrange(2, 5))]
        body = []
        for _ in range(rng.randrange(3, 6)):
            body += seg + [rng.randrange(5, vocab) for _ in range(rng.randrange(1, 4))]
        prompts.append(body + seg)
    return prompts


def _count_trees(eng) -> list[int]:
    """Wraps the proposer's draft_parents: the returned list counts the branching trees the engine verified."""
    counted = [0]
    proposer = eng.proposer
    inner = proposer.draft_parents

    def counting(seq_id, n):
        parents = inner(seq_id, n)
        counted[0] += parents is not None
        return parents
    proposer.draft_parents = counting
    return counted


def _prompts(path, vocab, params, num, seed, **kw) -> list[list[int]]:
    """`num` branchy prompts whose plain continuation never has a top-2 gap below MIN_MARGIN (fp32 plain and tree
    steps compute a position through different kernels: only near-ties could flip)."""
    probe = params.clone()
    probe.logprobs, probe.logprobs_mode = 2, "processed"
    candidates = _branchy_prompts(vocab, 3 * num, seed)
    outs = _generate(_make_llm(path, **kw), candidates, probe)
    chosen = [p for p, out in zip(candidates, outs)
              if min(g[0] - g[1] for g in ([sorted((lp.logprob for lp in s.values()), reverse=True)
                                              for s in out.logprobs])) > MIN_MARGIN]
    assert len(chosen) >= num, "not enough tie-free prompts"
    return chosen[:num]


@pytest.mark.parametrize("batch", [1, 8])
def test_ngram_tree_greedy_equals_plain_decoding(tiny_llama_dir, vocab, batch):
    params = _greedy(MAX_TOKENS)
    prompts = _prompts(tiny_llama_dir, vocab, params, 8, seed=batch)
    ref = _generate(_make_llm(tiny_llama_dir, max_num_seqs=batch), prompts, params)
    llm = _make_llm(tiny_llama_dir, max_num_seqs=batch, speculative_config=_tree(4, 10, disable_by_batch_size=64))
    eng = llm.llm_engine
    trees = _count_trees(eng)
    outs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert trees[0] > 0 and eng.spec_stats.num_accepted_draft_tokens > 0
    assert eng.spec_stats.num_proposer_errors == 0
    _assert_all_blocks_free(eng)


def test_ngram_tree_with_prefix_cache_and_preemption(tiny_llama_dir, vocab):
    kw = dict(block_size=4, num_kv_blocks=70, enable_prefix_caching=True)
    params = _greedy(MAX_TOKENS)
    prompts = _prompts(tiny_llama_dir, vocab, params, 8, seed=11, **kw)
    prompts = prompts + [list(p) for p in prompts[:3]]  # repeats: prefix-cache hits
    ref = _generate(_make_llm(tiny_llama_dir, **kw), prompts, params)
    llm = _make_llm(tiny_llama_dir, speculative_config=_tree(4, 8, disable_by_batch_size=64), **kw)
    eng = llm.llm_engine
    trees = _count_trees(eng)
    eng.scheduler = recorder = CountingScheduler(eng.scheduler)
    outs = _generate(llm, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert trees[0] > 0 and eng.spec_stats.num_accepted_draft_tokens > 0
    assert recorder.num_preempted > 0 and eng.scheduler.prefix_cache_hits > 0
    _assert_all_blocks_free(eng)


@pytest.mark.parametrize("batch", [1, 8])
def test_bf16_ngram_tree_greedy_equals_plain_without_tie_selection(tiny_llama_dir, vocab, batch):
    """bf16, no tie-free selection: tree rows must round exactly as single-token decode rows (top-5 raw logits
    compared as exact floats)."""
    params = _greedy(32, logprobs=5, logprobs_mode="raw_logits")
    prompts = _branchy_prompts(vocab, 8, seed=23)
    ref = _generate(_make_llm(tiny_llama_dir, dtype="bfloat16", max_num_seqs=1), prompts, params)
    llm = _make_llm(tiny_llama_dir, dtype="bfloat16", max_num_seqs=batch,
                    speculative_config=_tree(3, 8, disable_by_batch_size=64))
    eng = llm.llm_engine
    trees = _count_trees(eng)
    outs = _generate(llm, prompts, params)
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]
    assert trees[0] > 0 and eng.spec_stats.num_accepted_draft_tokens > 0
    _assert_all_blocks_free(eng)


def test_seeded_sampled_rows_take_chains_and_reproduce(tiny_llama_dir, vocab):
    prompts = _branchy_prompts(vocab, 6, seed=5)
    params = [SamplingParams(temperature=0.3, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(6)]

    def run():
        llm = _make_llm(tiny_llama_dir, speculative_config=_tree(3, 8, disable_by_batch_size=64))
        trees = _count_trees(llm.llm_engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine, trees[0]

    (first, eng, num_trees), (second, _, _) = run(), run()
    assert first == second and num_trees == 0  # sampled rows never verify a tree (rejection sampling needs a chain)
    assert eng.spec_stats.num_draft_tokens > 0
    _assert_all_blocks_free(eng)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_steps_replay_from_step_graphs_bit_for_bit(tiny_llama_dir, vocab, dtype, monkeypatch):
    """Tree verification steps replay through step graphs keyed by their shape (the tree is data); every replay
    is also run eagerly and compared bit for bit (PAGELLM_STEP_GRAPH_CHECK), and the outputs (tokens and top-5 raw
    logits) equal an enforce_eager run's."""
    params = _greedy(32, logprobs=5, logprobs_mode="raw_logits")
    prompts = _branchy_prompts(vocab, 6, seed=31)
    config = _tree(3, 8, disable_by_batch_size=64, adaptive=False)
    eager = _generate(_make_llm(tiny_llama_dir, dtype=dtype, max_num_seqs=2, enforce_eager=True,
                                speculative_config=config), prompts, params)
    monkeypatch.setenv("PAGELLM_STEP_GRAPH_CHECK", "1")
    llm = _make_llm(tiny_llama_dir, dtype=dtype, max_num_seqs=2, speculative_config=config)
    eng = llm.llm_engine
    trees = _count_trees(eng)
    outs = _generate(llm, prompts, params)
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in eager]
    assert [o.logprobs for o in outs] == [o.logprobs for o in eager]
    graphs = eng.runner.step_graphs
    tree_replays = sum(n for key, n in graphs.num_replays_by_key.items() if key[0] == "tree")
    assert trees[0] > 0 and tree_replays > 0 and graphs.check
    _assert_all_blocks_free(eng)
