"""End to end: LLM / LLMEngine on tiny random-weight Llama checkpoints vs Hugging Face."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 32
PROMPT_LENS = [3, 15, 16, 17, 31, 40, 5, 33]


def _prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lens]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="module")
def hf_reference(hf_model, tiny_tokenizer):
    prompts = _prompts(len(tiny_tokenizer))
    return prompts, [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]


def _greedy(n=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _make_llm(path, **kw):
    kw.setdefault("max_model_len", 256)
    kw.setdefault("seed", 0)
    return LLM(str(path), **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _make_llm(tiny_llama_dir)


def _free_blocks(llm) -> int:
    return llm.llm_engine.num_free_blocks


@pytest.mark.parametrize("kw", [
    dict(),
    dict(block_size=1),
    dict(block_size=128),
    dict(max_num_batched_tokens=8),  # chunked prefill
    dict(block_size=4, num_kv_blocks=40, max_model_len=128),  # tiny KV cache: preemption
], ids=["default", "bs1", "bs128", "chunked", "preempt"])
def test_greedy_matches_hf(tiny_llama_dir, hf_reference, kw):
    prompts, expected = hf_reference
    llm = _make_llm(tiny_llama_dir, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    for o, exp in zip(outs, expected):
        assert o.outputs[0].token_ids == exp
        assert o.outputs[0].finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests()


def test_prefix_cache_hit(llm, hf_model, tiny_tokenizer):
    rng = random.Random(7)
    prefix = [rng.randrange(5, len(tiny_tokenizer)) for _ in range(70)]
    a = llm.generate({"prompt_token_ids": prefix + [11, 12]}, _greedy(16), use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": prefix + [11, 12]}, _greedy(16), use_tqdm=False)[0]
    c = llm.generate({"prompt_token_ids": prefix + [13]}, _greedy(16), use_tqdm=False)[0]
    assert b.num_cached_tokens >= 64 and c.num_cached_tokens >= 64
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == hf_greedy(hf_model, prefix + [11, 12], 16)
    assert c.outputs[0].token_ids == hf_greedy(hf_model, prefix + [13], 16)
    llm.reset_prefix_cache()
    d = llm.generate({"prompt_token_ids": prefix + [11, 12]}, _greedy(4), use_tqdm=False)[0]
    assert d.num_cached_tokens == 0


def test_logprobs_match_hf(llm, hf_model, tiny_tokenizer):
    prompt = _prompts(len(tiny_tokenizer), [20])[0]
    k = 5
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(8, logprobs=k, prompt_logprobs=k), use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + toks])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    # prompt logprobs: None, then position p-1 predicting prompt[p]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        d = out.prompt_logprobs[p]
        row = lp[p - 1]
        assert prompt[p] in d
        assert abs(d[prompt[p]].logprob - row[prompt[p]].item()) < 1e-4
        assert d[prompt[p]].rank == int((row > row[prompt[p]]).sum()) + 1
        top = row.topk(k)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[tid].logprob - val) < 1e-4
    cum = 0.0
    for i, t in enumerate(toks):
        d = out.outputs[0].logprobs[i]
        row = lp[len(prompt) - 1 + i]
        assert abs(d[t].logprob - row[t].item()) < 1e-4 and d[t].rank == 1
        top = row.topk(k)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(d[tid].logprob - val) < 1e-4
        cum += row[t].item()
    assert abs(out.outputs[0].cumulative_logprob - cum) < 1e-3


def test_batch_invariance_greedy_and_seeded(llm, tiny_tokenizer):
    V = len(tiny_tokenizer)
    target = _prompts(V, [23], seed=3)[0]
    alone = llm.generate({"prompt_token_ids": target}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(V, [random.Random(i).randrange(2, 40) for i in range(31)], seed=4)
    batch = others[:13] + [target] + others[13:]
    params = [SamplingParams(temperature=0.8, max_tokens=random.Random(i).randrange(2, 24), ignore_eos=True)
              for i in range(len(batch))]
    params[13] = _greedy()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert outs[13].outputs[0].token_ids == alone

    seeded = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=42, max_tokens=20, ignore_eos=True)
    one = llm.generate({"prompt_token_ids": target}, seeded, use_tqdm=False)[0]
    seqs = [o.token_ids for o in one.outputs]
    assert [o.index for o in one.outputs] == [0, 1, 2]
    assert len({tuple(s) for s in seqs}) > 1  # children differ
    params[13] = seeded
    mixed = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)[13]
    assert [o.token_ids for o in mixed.outputs] == seqs
    again = llm.generate({"prompt_token_ids": target}, seeded, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == seqs


def test_text_prompts_chat_and_stop(llm, tiny_tokenizer):
    out = llm.generate(["The sea is", "héllo"], _greedy(12), use_tqdm=False)
    for o in out:
        assert o.prompt is not None and o.outputs[0].text == tiny_tokenizer.decode(
            o.outputs[0].token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    chat = llm.chat([{"role": "user", "content": "hi"}], _greedy(5), use_tqdm=False)[0]
    assert chat.prompt_token_ids[0] == tiny_tokenizer.bos_token_id and len(chat.outputs[0].token_ids) == 5
    # a stop string taken from the greedy text itself
    full = out[0].outputs[0].text
    if len(full) >= 6:
        stop = full[3:6]
        cut = llm.generate("The sea is", _greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == full[: full.find(stop)]


def test_invalid_requests_leave_engine_usable(llm, tiny_tokenizer):
    eng = llm.llm_engine
    V = len(tiny_tokenizer)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("bad0", {"prompt_token_ids": []}, _greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("bad1", {"prompt_token_ids": [5] * 250}, _greedy(10))
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("bad2", {"prompt_token_ids": [5] * 300}, _greedy(1))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("bad3", {"prompt_token_ids": [5, V]}, _greedy())
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("bad4", {"prompt_token_ids": [5, -1]}, _greedy())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    sp = _greedy()
    sp.temperature = math.nan  # mutated after construction
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("bad5", {"prompt_token_ids": [5, 6]}, sp)
    eng.add_request("dup", {"prompt_token_ids": [5, 6]}, _greedy(2))
    with pytest.raises(ValueError, match="dup"):
        eng.add_request("dup", {"prompt_token_ids": [5, 6]}, _greedy(2))
    eng.abort_request("dup")
    assert not eng.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_streaming_step_outputs(llm):
    eng = llm.llm_engine
    eng.add_request("s0", {"prompt_token_ids": [5, 6, 7, 8]}, _greedy(6))
    seen = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.append(len(o.outputs[0].token_ids))
            final = o
    assert seen == [1, 2, 3, 4, 5, 6] and final.finished
    assert final.metrics.ttft is not None and final.metrics.ttft >= 0


def test_random_requests_with_aborts_free_all_blocks(tiny_llama_dir, tiny_tokenizer):
    llm = _make_llm(tiny_llama_dir, max_model_len=64, block_size=4, num_kv_blocks=120, max_num_seqs=32)
    eng = llm.llm_engine
    free0 = _free_blocks(llm)
    rng = random.Random(0)
    V = len(tiny_tokenizer)
    live: set[str] = set()
    for i in range(500):
        n = rng.choice([1, 1, 1, 2, 3])
        sp = SamplingParams(n=n, temperature=rng.choice([0.0, 1.0]), seed=rng.choice([None, i]),
                            max_tokens=rng.randrange(1, 6), ignore_eos=rng.random() < 0.5)
        eng.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(5, V) for _ in range(rng.randrange(1, 12))]}, sp)
        live.add(f"r{i}")
        if rng.random() < 0.3:
            for o in eng.step():
                if o.finished:
                    live.discard(o.request_id)
        if live and rng.random() < 0.15:
            victim = rng.choice(sorted(live))
            eng.abort_request(victim)
            live.discard(victim)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                live.discard(o.request_id)
    assert not live
    assert _free_blocks(llm) == free0


def test_warmup_leaves_engine_as_it_was(tiny_llama_dir, hf_reference):
    """LLMEngine.warmup (run by `pagellm serve` before it accepts requests): no request left, every KV block
    free, nothing in the prefix cache, token counters unchanged; later generation still matches HF."""
    prompts, expected = hf_reference
    llm = _make_llm(tiny_llama_dir, max_model_len=128)
    eng = llm.llm_engine
    free, counters = _free_blocks(llm), (eng.num_prompt_tokens_total, eng.num_generation_tokens_total)
    took = eng.warmup(prompt_lens=(5, 60, 400))  # 400 > max_model_len: clamped, not an error
    assert took > 0
    assert not eng.has_unfinished_requests() and _free_blocks(llm) == free
    assert (eng.num_prompt_tokens_total, eng.num_generation_tokens_total) == counters
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens == 0 for o in outs)  # warm-up blocks were not kept as cached prefixes
    llm.generate({"prompt_token_ids": prompts[0]}, _greedy(2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="idle"):
        eng.add_request("busy", {"prompt_token_ids": prompts[0]}, _greedy(2))
        eng.warmup()
    eng.abort_request("busy")
    assert _free_blocks(llm) == free
