"""The engine on device="cuda" against HF transformers on the same GPU and weights (tools/gpu/engine_check.py as a
test): fp32 greedy tokens equal HF's, eager and with CUDA graphs; prompt logprobs match HF's within fp32 rounding;
a prompt alone gives the tokens it gives inside a batch (batch invariance of the greedy output)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 16
LENS = [3, 15, 16, 17, 40, 70]  # across the 16-token block boundary


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaForCausalLM

    from tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("llama64-cuda"), tiny_tokenizer, hidden_size=256, num_heads=4,
                            num_kv_heads=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, len(tiny_tokenizer)) for _ in range(n)] for n in LENS]
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    greedy, prompt_lps = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)
            greedy.append(out[0, len(p):].tolist())
            logp = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0].float(), -1)
            prompt_lps.append([float(logp[i - 1, p[i]]) for i in range(1, len(p))])
    return path, prompts, greedy, prompt_lps


def _llm(path, eager: bool):
    from pagellm import LLM

    return LLM(str(path), device="cuda", dtype="float32", enforce_eager=eager, max_model_len=256, seed=0,
               kv_cache_memory_gb=0.25)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_matches_hf(setup, eager):
    from pagellm import SamplingParams

    path, prompts, greedy, _ = setup
    llm = _llm(path, eager)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy
    alone = llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(alone) == greedy[4]
    assert llm.llm_engine.executor.driver_worker.kv_caches[0].key_cache.is_cuda  # the KV cache lives on the GPU


def test_prompt_logprobs_match_hf(setup):
    from pagellm import SamplingParams

    path, prompts, _, prompt_lps = setup
    llm = _llm(path, eager=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for o, p, ref in zip(outs, prompts, prompt_lps):
        got = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        assert got == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_sampling_on_the_device(setup, eager):
    """Sampled decoding on CUDA (the noise is drawn on the device, session 17: a CPU generator failed every sampled
    step): a seeded request repeats itself, unseeded and seeded rows share a batch, top-k / top-p / logprobs run, and
    every token is in the vocabulary and comes with its logprob."""
    from pagellm import SamplingParams

    path, prompts, _, _ = setup
    llm = _llm(path, eager)
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=NEW, seed=7, ignore_eos=True, logprobs=2)
    free = SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts[:3]]
    first = llm.generate(reqs, [seeded, free, seeded], use_tqdm=False)
    again = llm.generate(reqs[:1], seeded, use_tqdm=False)
    assert list(first[0].outputs[0].token_ids) == list(again[0].outputs[0].token_ids)
    assert list(first[2].outputs[0].token_ids) != [] and len(first[1].outputs[0].token_ids) == NEW
    vocab = llm.llm_engine.vocab_size
    for o in first:
        assert all(0 <= t < vocab for t in o.outputs[0].token_ids)
    for t, lp in zip(first[0].outputs[0].token_ids, first[0].outputs[0].logprobs):
        assert t in lp and lp[t].logprob <= 0.0
