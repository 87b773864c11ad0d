"""A mixed model (Gemma 2 / Gemma 3: sliding-window and full-attention layers) on a hybrid KV cache: the
sliding layers' group has its own block ids and frees the blocks that left its window while the full group
keeps all of them. Against HF transformers in float32 (prompt logprobs, 32 greedy tokens) far past the window,
the sliding group's live blocks bounded over a long decode, prefix caching with forced preemption equal to a
roomy run with every block freed; plus the grouping, sizing, per-group caches and per-group metadata."""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers as tf

from paged_model_utils import hf_greedy_batch, hf_prompt_logprobs, make_tiny_hf, random_prompts
from pagellm.attention.base import AttentionMetadata
from pagellm.kv_cache import KVCaches, PagedKVCache, allocate_kv_caches, group_kv_cache_specs, make_kv_cache_config
from pagellm.kv_cache.groups import is_mixed_window_model
from pagellm.kv_cache.sizing import determine_group_num_blocks, max_blocks_per_request
from pagellm.kv_cache.spec import FullAttentionSpec, SharedKVSpec, SlidingWindowSpec
from scheduler_probes import CountingScheduler

S, F = "sliding_attention", "full_attention"
NEW_TOKENS = 32
TOL = 1e-4
F32 = torch.float32
CASES = {  # windows that end inside a block at block size 4; 4 layers, 3 sliding : 1 full in Gemma 3 (5:1 upstream)
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(
        head_dim=16, num_hidden_layers=3, sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
        final_logit_softcapping=4.0, tie_word_embeddings=True), 6),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        head_dim=16, num_hidden_layers=4, sliding_window=7, query_pre_attn_scalar=24, layer_types=[S, S, F, S],
        rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                         F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        final_logit_softcapping=6.0, tie_word_embeddings=False), 7),
}


# ------------------------------------------------------------------------------------- grouping and sizing
def _sliding(w=8):
    return SlidingWindowSpec(4, 2, 16, F32, w)


def _full():
    return FullAttentionSpec(4, 2, 16, F32)


def test_mixed_models_split_into_a_group_per_window():
    specs = {0: _sliding(), 1: _full(), 2: _sliding(), 3: SharedKVSpec(2), 4: _sliding(12)}
    assert is_mixed_window_model(specs)
    assert not is_mixed_window_model({0: _sliding(), 1: _sliding()})  # one window: one table frees already
    assert not is_mixed_window_model({0: _full(), 1: _full()})
    assert len(group_kv_cache_specs(specs)) == 1  # same page shape: today's one group, the window a mask
    groups = group_kv_cache_specs(specs, split_windows=True)
    assert [(g.layer_ids, g.sliding_window, g.shared_layer_ids) for g in groups] == [
        ((0, 2, 3), 8, (3,)), ((1,), 0, ()), ((4,), 12, ())]


def test_hybrid_sizing_buys_whole_requests_then_gives_the_rest_to_full_groups():
    specs = {0: _sliding(8), 1: _full(), 2: _sliding(8)}
    groups = group_kv_cache_specs(specs, split_windows=True)
    page = _full().page_size_bytes
    kw = dict(device=torch.device("cpu"), max_model_len=64, max_num_seqs=3, max_chunk_tokens=8)
    per_sliding = max_blocks_per_request(4, 64, 8, 8)  # ceil(15 / 4) + 1 = 5
    assert per_sliding == 5
    # a request costs 5 blocks of 2 sliding pages + 16 blocks of 1 full page; 2 fit in this budget
    budget = (2 * (5 * 2 + 16) + 2 + 3) * page  # + the null block's pages + a little
    counts = determine_group_num_blocks(groups, kv_cache_memory_gb=budget / 2**30, **kw)
    assert counts[0] == 2 * 5 + 1  # the sliding group: two requests' windows and its null block
    assert counts[1] == (budget - counts[0] * 2 * page) // page  # the full group: the rest
    roomy = determine_group_num_blocks(groups, kv_cache_memory_gb=1.0, **kw)
    assert roomy == (3 * 5 + 1, 3 * 16)  # capped at max_num_seqs max-length requests
    assert determine_group_num_blocks(groups, num_blocks_override=20, **kw) == (20, 20)
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len=64"):
        determine_group_num_blocks(groups, num_blocks_override=10, **kw)
    config = make_kv_cache_config(specs, torch.device("cpu"), 64, 3, kv_cache_memory_gb=1.0, max_chunk_tokens=8)
    assert config.is_hybrid and config.num_block_tables == 2 and config.group_num_blocks == roomy
    assert config.num_blocks == roomy[0] and config.sliding_window == 8 and config.extra_groups == [(48, 0)]
    assert config.total_bytes == roomy[0] * 2 * page + roomy[1] * page
    stage = make_kv_cache_config(specs, torch.device("cpu"), 64, 3, num_blocks_override=20, free_sliding_blocks=False)
    assert not stage.is_hybrid and stage.num_block_tables == 1 and stage.sliding_window == 0  # a pipeline stage


def test_per_group_caches_and_copies():
    specs = {0: _sliding(8), 1: _full(), 2: SharedKVSpec(1)}
    config = make_kv_cache_config(specs, torch.device("cpu"), 64, 3, kv_cache_memory_gb=1.0, max_chunk_tokens=8)
    kv = allocate_kv_caches(config, torch.device("cpu"))
    assert kv.num_groups == 2 and kv.group_num_blocks == list(config.group_num_blocks)
    assert kv[0].num_blocks == config.group_num_blocks[0] and kv[1].num_blocks == config.group_num_blocks[1]
    assert kv.layer_groups == {0: 0, 1: 1, 2: 1}
    for t in kv.tensors():
        t.copy_(torch.randn_like(t))
    before = [t.clone() for t in kv.tensors()]
    kv.copy_blocks(torch.tensor([[2, 5]]), group=1)  # group 1's ids: layer 1 only
    assert torch.equal(kv[1].key_cache[5], kv[1].key_cache[2]) and torch.equal(kv[1].value_cache[5], before[3][2])
    assert torch.equal(kv[0].key_cache, before[0]) and torch.equal(kv[0].value_cache, before[1])
    one = PagedKVCache(_full(), torch.zeros(3, 2, 4, 16), torch.zeros(3, 2, 4, 16))
    other = PagedKVCache(_full(), torch.zeros(5, 2, 4, 16), torch.zeros(5, 2, 4, 16))
    assert KVCaches({0: one, 1: other}, layer_groups={0: 0, 1: 1}).group_num_blocks == [3, 5]
    with pytest.raises(ValueError, match="group 0 must have the same num_blocks"):
        KVCaches({0: one, 1: other}, layer_groups={0: 0, 1: 0})
    with pytest.raises(ValueError, match="layer_groups must name the group of every owning layer"):
        KVCaches({0: one, 1: other}, layer_groups={0: 0})


def test_metadata_for_group():
    t = torch.arange(6, dtype=torch.int32)
    md = AttentionMetadata(num_reqs=2, num_tokens=3, num_decode_reqs=1, max_query_len=2, max_seq_len=5,
                           slot_mapping=torch.tensor([1, 2, 3]), block_tables=t.view(2, 3), seq_lens=t[:2],
                           query_start_loc=t[:3], group_slot_mappings=(torch.tensor([7, 8, 9]),),
                           group_block_tables=(t.view(2, 3) + 10,))
    assert md.num_kv_cache_groups == 2
    g1 = md.for_group(1)
    assert g1.slot_mapping.tolist() == [7, 8, 9] and g1.block_tables[0, 0].item() == 10
    assert g1.num_kv_cache_groups == 1 and g1.seq_lens is md.seq_lens
    assert md.for_group(0).slot_mapping.tolist() == [1, 2, 3] and md.for_group(0).num_kv_cache_groups == 1


# ------------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module", params=list(CASES))
def gemma(request, tmp_path_factory, tiny_tokenizer):
    cfg_cls, model_cls, overrides, window = CASES[request.param]
    hf = make_tiny_hf(cfg_cls, model_cls, seed=7, **{**overrides, "vocab_size": len(tiny_tokenizer)})
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return request.param, str(path), hf, window


def _llm(path, **kw):
    pytest.importorskip("pagellm._C", reason="the engine needs the C++ extension (make install)")
    from pagellm import LLM

    args = dict(dtype="float32", max_model_len=160, block_size=4, max_num_batched_tokens=16, seed=0)
    args.update(kw)
    return LLM(path, **args)


def _greedy(n=NEW_TOKENS, **kw):
    from pagellm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("block_size,backend", [(1, "auto"), (4, "auto"), (4, "torch")])
def test_matches_hf_far_past_the_window(gemma, block_size, backend):
    """The default backend and the pure-torch reference (it masks the null entries rather than skipping them)."""
    name, path, hf, window = gemma
    llm = _llm(path, block_size=block_size, num_kv_blocks=1024 // block_size, attention_backend=backend)
    sched = llm.llm_engine.scheduler
    assert sched.num_kv_cache_groups == 2 and llm.llm_engine.kv_cache_config.is_hybrid
    prompts = random_prompts([3, 29, 75], hf.config.vocab_size, seed=block_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(prompt_logprobs=0), use_tqdm=False)
    want = hf_greedy_batch(hf, prompts, NEW_TOKENS)
    for p, out, ref in zip(prompts, outs, want):
        assert list(out.outputs[0].token_ids) == ref, f"{name}: prompt of {len(p)} tokens, block {block_size}"
        ref_lp = hf_prompt_logprobs(hf, p)[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        got = torch.tensor([lps[tok].logprob for tok, lps in zip(p[1:], out.prompt_logprobs[1:])])
        err = (got - ref_lp).abs().max().item() if len(p) > 1 else 0.0
        assert err < TOL, f"{name}: prompt of {len(p)} tokens, block {block_size}: max |dlogprob| {err}"
    assert sched.num_free_blocks == sched.num_blocks - sched.num_reserved_blocks


def test_sliding_group_holds_only_the_windows_blocks(gemma):
    name, path, hf, window = gemma
    engine = _llm(path, num_kv_blocks=64, enable_prefix_caching=False).llm_engine
    sched = engine.scheduler
    sliding = next(g for g, grp in enumerate(engine.kv_cache_config.groups) if grp.sliding_window)
    full = 1 - sliding
    prompt = random_prompts([41], hf.config.vocab_size, seed=1)[0]
    engine.add_request("long", {"prompt_token_ids": prompt}, _greedy(110))
    bound = math.ceil(window / 4) + 1
    live, full_live = [], []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests() and sched.get_num_computed_tokens("long") >= len(prompt):
            live.append(sched.get_num_live_blocks("long", sliding))
            full_live.append(sched.get_num_live_blocks("long", full))
            computed = sched.get_num_computed_tokens("long")
            assert len(sched.get_block_table("long", sliding)) == len(sched.get_block_table("long", full))
            assert full_live[-1] == len(sched.get_block_table("long", full)) >= computed / 4
    assert len(live) >= 100
    assert max(live) <= bound, (name, max(live), bound)
    assert max(full_live) >= (len(prompt) + 100) // 4  # the full group keeps every block
    assert sched.group_num_free_blocks(sliding) == sched.group_num_blocks(sliding) - 1  # all but its null block
    assert sched.group_num_free_blocks(full) == sched.group_num_blocks(full)
    stats = engine.get_stats()
    assert stats.num_total_blocks == stats.num_free_blocks and stats.kv_cache_usage == 0.0
    graphs = engine.runner.step_graphs  # CPU decodes replay with every group's slot mapping and tables as inputs
    assert graphs is None or graphs.num_replays > 0


def test_prefix_caching_and_preemption_match_hf(gemma):
    """Requests sharing a 30-token prefix in a cache too small for all of them at once: preemptions and prefix
    hits (a hit in both groups) happen, the greedy tokens equal HF's, and every block of both groups is freed."""
    name, path, hf, window = gemma
    g = random.Random(11)
    prefix = [g.randrange(5, hf.config.vocab_size) for _ in range(30)]
    prompts = [prefix + [g.randrange(5, hf.config.vocab_size) for _ in range(2 + 3 * i)] for i in range(6)]
    want = hf_greedy_batch(hf, prompts, NEW_TOKENS)
    llm = _llm(path, max_model_len=96, num_kv_blocks=26, enable_prefix_caching=True)
    engine = llm.llm_engine
    warm = llm.generate({"prompt_token_ids": prompts[0]}, _greedy(), use_tqdm=False)[0]
    assert list(warm.outputs[0].token_ids) == want[0]
    engine.scheduler = counter = CountingScheduler(engine.scheduler)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want, name
    assert counter.num_preempted > 0, "the cache was meant to force a preemption"
    assert counter.prefix_cache_hits > 0 and outs[0].num_cached_tokens >= 28
    groups = engine.kv_cache_config.groups
    for grp in range(counter.num_kv_cache_groups):
        null = 1 if groups[grp].sliding_window else 0
        assert counter.group_num_free_blocks(grp) == counter.group_num_blocks(grp) - null, (name, grp)


def test_bad_hybrid_scheduler_input_is_refused():
    _C = pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
    with pytest.raises(ValueError, match=r"extra_groups\[0\].num_blocks must be >= 2 with a sliding window"):
        _C.Scheduler(num_blocks=16, block_size=4, extra_groups=[(1, 8)])
    with pytest.raises(ValueError, match=r"extra_groups\[1\].sliding_window must be >= 0"):
        _C.Scheduler(num_blocks=16, block_size=4, extra_groups=[(8, 8), (8, -2)])
    s = _C.Scheduler(num_blocks=16, block_size=4, max_model_len=64, extra_groups=[(4, 8)])
    with pytest.raises(ValueError, match="KV blocks of group 1 but only 3 can be admitted"):
        s.add_request("long", list(range(20)))  # 5 sliding blocks at once (no chunking below 20 tokens)
    s.add_request("r", list(range(6)))
    out = s.schedule()
    assert out.num_kv_cache_groups == 2 and out.group_slot_mapping(1).shape == out.slot_mapping.shape
    assert out.group_block_tables(1).shape == out.block_tables.shape and len(out.cow_copy_groups) == 0
    with pytest.raises(IndexError, match="no KV-cache group 2"):
        out.group_slot_mapping(2)
    with pytest.raises(IndexError):
        s.get_block_table("r", 2)
    with pytest.raises(ValueError, match="group_num_blocks must hold one integer >= 1 per group"):
        config = make_kv_cache_config({0: _sliding(), 1: _full()}, torch.device("cpu"), 64, 2, num_blocks_override=20)
        type(config)(num_blocks=20, groups=config.groups, layer_specs=config.layer_specs, group_num_blocks=(20,))


def test_ngram_speculation_keeps_the_tokens(gemma):
    """Spec rows write drafts into every group's lookahead slots and shrink the rejected ones in each; the sliding
    group's dropped blocks must not change a token."""
    name, path, hf, window = gemma
    g = random.Random(5)
    prompts = [[g.randrange(5, hf.config.vocab_size) for _ in range(n)] * 5 for n in (5, 9)]
    want = [list(o.outputs[0].token_ids) for o in _llm(path, num_kv_blocks=128).generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(40), use_tqdm=False)]
    spec = _llm(path, num_kv_blocks=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "adaptive": False})
    got = [list(o.outputs[0].token_ids) for o in spec.generate([{"prompt_token_ids": p} for p in prompts],
                                                                _greedy(40), use_tqdm=False)]
    assert got == want, name
    sched = spec.llm_engine.scheduler
    assert sched.num_kv_cache_groups == 2 and sched.num_free_blocks == sched.num_blocks - sched.num_reserved_blocks
