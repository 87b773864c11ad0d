"""A model whose every layer slides (Mistral with sliding_window) frees the KV blocks that left the window:
the engine matches HF transformers (fp32 prompt logprobs, greedy tokens) with prompts and generations far
longer than the window, a decoding request holds at most the window's blocks, and prefix caching with
forced preemption gives the same tokens and frees every block."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402

WINDOW = 8
NEW_TOKENS = 32
PROMPT_LENS = [3, 41, 97]  # shorter than, and many times, the window
TOL = 1e-4


def _write_tiny_mistral(path, tokenizer, window: int, full_attention: bool = False, seed: int = 0):
    """Random-weight MistralForCausalLM (float32) with `window` on every layer (None: full attention)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        sliding_window=None if full_attention else window, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = MistralForCausalLM(cfg).float().eval()
    with torch.no_grad():  # larger logits than the default init: fewer argmax near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp("mistral-sliding")
    hf = _write_tiny_mistral(path, tiny_tokenizer, WINDOW)
    g = random.Random(3)
    prompts = [[g.randrange(5, len(tiny_tokenizer)) for _ in range(n)] for n in PROMPT_LENS]
    return str(path), hf, prompts


def _hf_reference(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens and the prompt's log-probabilities [len - 1] of each next prompt token."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    nxt = torch.tensor(prompt[1:])
    return out[0, len(prompt):].tolist(), logp[torch.arange(len(prompt) - 1), nxt]


def _llm(path: str, block_size: int, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=256, block_size=block_size, max_num_batched_tokens=32, seed=0)
    args.update(kw)
    return LLM(path, **args)


@pytest.mark.parametrize("block_size", [1, 16])
def test_matches_hf_far_past_the_window(mistral, block_size):
    path, hf, prompts = mistral
    llm = _llm(path, block_size, num_kv_blocks=4096 // block_size)
    sched = llm.llm_engine.scheduler
    assert sched.sliding_window == WINDOW and sched.null_block == 0
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref_tokens, ref_lp = _hf_reference(hf, p)
        assert list(out.outputs[0].token_ids) == ref_tokens, f"prompt of {len(p)} tokens, block {block_size}"
        got = torch.tensor([lps[tok].logprob for tok, lps in zip(p[1:], out.prompt_logprobs[1:])])
        assert (got - ref_lp).abs().max().item() < TOL, f"prompt of {len(p)} tokens, block {block_size}"
    assert sched.num_free_blocks == sched.num_blocks - 1  # all but the null block


@pytest.mark.parametrize("block_size", [1, 4])
def test_decoding_holds_only_the_windows_blocks(mistral, block_size):
    path, _, prompts = mistral
    engine = _llm(path, block_size, num_kv_blocks=512 // block_size, enable_prefix_caching=False).llm_engine
    sched = engine.scheduler
    bound = math.ceil(WINDOW / block_size) + 1
    engine.add_request("long", {"prompt_token_ids": prompts[2]},
                       SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True))
    live_while_decoding = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests() and sched.get_num_computed_tokens("long") >= len(prompts[2]):
            live_while_decoding.append(sched.get_num_live_blocks("long"))
            table = sched.get_block_table("long")
            assert len(table) * block_size >= sched.get_num_computed_tokens("long")  # the table keeps its length
    assert len(live_while_decoding) >= 140
    assert max(live_while_decoding) <= bound, (max(live_while_decoding), bound)
    assert sched.num_free_blocks == sched.num_blocks - 1
    stats = engine.get_stats()  # what /metrics reports: no block in use, the null block not counted
    assert stats.num_total_blocks == stats.num_free_blocks and stats.kv_cache_usage == 0.0


def test_prefix_caching_and_preemption_match_a_roomy_run(mistral):
    """Eight requests sharing a 60-token prefix in a cache too small for all of them: preemptions happen,
    prefix hits happen, the greedy tokens equal a run with room for everything, and every block is freed."""
    path, _, _ = mistral
    g = random.Random(11)
    prefix = [g.randrange(5, 300) for _ in range(60)]
    prompts = [prefix + [g.randrange(5, 300) for _ in range(3 + i)] for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    roomy = _llm(path, 4, num_kv_blocks=2048, enable_prefix_caching=False)
    want = [list(o.outputs[0].token_ids) for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                   use_tqdm=False)]
    del roomy

    # a 32-token chunk spans up to ceil((8 - 1 + 32) / 4) + 1 = 11 blocks, a decode 3: 15 usable blocks are tight
    engine = _llm(path, 4, num_kv_blocks=16, enable_prefix_caching=True).llm_engine
    sched = engine.scheduler
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    got: dict[str, list[int]] = {}
    preemptions = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        live = [f"r{i}" for i in range(8) if f"r{i}" not in got]
        preemptions = max([preemptions] + [sched.get_request(r).num_preemptions for r in live])
    assert [got[f"r{i}"] for i in range(8)] == want
    assert preemptions > 0, "the cache was meant to force a preemption"
    assert sched.prefix_cache_hits > 0
    assert sched.num_free_blocks == sched.num_blocks - 1


def test_full_attention_model_reserves_no_block(tmp_path, tiny_tokenizer):
    _write_tiny_mistral(tmp_path, tiny_tokenizer, WINDOW, full_attention=True)
    sched = _llm(str(tmp_path), 16, num_kv_blocks=64).llm_engine.scheduler
    assert sched.sliding_window == 0 and sched.null_block == -1
    assert sched.num_free_blocks == sched.num_blocks == 64


def test_block_manager_window_needs_every_layer_sliding_by_one_window():
    from pagellm.kv_cache.groups import block_manager_window
    from pagellm.kv_cache.spec import FullAttentionSpec, SharedKVSpec, SlidingWindowSpec

    def sliding(w):
        return SlidingWindowSpec(16, 2, 64, torch.bfloat16, w)

    assert block_manager_window({0: sliding(32), 1: sliding(32)}) == 32
    assert block_manager_window({0: sliding(32), 1: FullAttentionSpec(16, 2, 64, torch.bfloat16)}) == 0  # Gemma-like
    assert block_manager_window({0: sliding(32), 1: sliding(64)}) == 0
    assert block_manager_window({0: sliding(32), 1: SharedKVSpec(0)}) == 0
    assert block_manager_window({0: FullAttentionSpec(16, 2, 64, torch.bfloat16)}) == 0


def test_sizing_caps_blocks_at_what_windowed_requests_hold():
    from pagellm.kv_cache import determine_num_blocks, group_kv_cache_specs
    from pagellm.kv_cache.sizing import max_blocks_per_request
    from pagellm.kv_cache.spec import SlidingWindowSpec

    groups = group_kv_cache_specs({0: SlidingWindowSpec(16, 2, 64, torch.bfloat16, 256)})
    assert max_blocks_per_request(16, 2048, 0, 512) == 128
    assert max_blocks_per_request(16, 2048, 256, 512) == 49  # ceil((255 + 512) / 16) + 1
    assert max_blocks_per_request(16, 64, 256, 64) == 4      # never more than the whole request
    kw = dict(device=torch.device("cpu"), max_model_len=2048, max_num_seqs=4, kv_cache_memory_gb=1.0)
    assert determine_num_blocks(groups, **kw) == 128 * 4 + 1
    assert determine_num_blocks(groups, **kw, sliding_window=256, max_chunk_tokens=512) == 49 * 4 + 1
    with pytest.raises(ValueError, match="cannot hold one request"):
        determine_num_blocks(groups, **kw, num_blocks_override=40, sliding_window=256, max_chunk_tokens=512)
    assert determine_num_blocks(groups, **kw, num_blocks_override=50, sliding_window=256, max_chunk_tokens=512) == 50


def test_ngram_speculation_keeps_the_tokens(mistral):
    """Spec rows write drafts past the window's end and shrink rejected slots; the blocks dropped behind
    them must not change a token (block size 4, copy-heavy prompts so drafts get accepted)."""
    path, _, _ = mistral
    g = random.Random(5)
    prompts = []
    for n in (5, 9, 13):
        segment = [g.randrange(5, 300) for _ in range(n)]
        prompts.append(segment * 6)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = _llm(path, 4, num_kv_blocks=256)
    want = [list(o.outputs[0].token_ids) for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                   use_tqdm=False)]
    del plain
    # adaptive off: the switch decides from measured step times, and this test needs every decode to draft
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    spec = _llm(path, 4, num_kv_blocks=256, speculative_config=ngram)
    got = [list(o.outputs[0].token_ids) for o in spec.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)]
    assert got == want
    assert spec.llm_engine.spec_stats.num_accepted_draft_tokens > 0
    sched = spec.llm_engine.scheduler
    assert sched.num_free_blocks == sched.num_blocks - 1
