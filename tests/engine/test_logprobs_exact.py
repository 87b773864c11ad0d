"""Logprobs an RL trainer can trust: the sampled token's (and the top-k) logprobs the engine returns, in each
logprobs_mode, equal a plain torch computation: an HF transformers fp32 forward of the same weights over
prompt + the tokens generated so far, then the sampling processing written out here (logit bias,
repetition / frequency / presence penalties, temperature, top-k, top-p), within 1e-5; and a request's
tokens and logprobs do not depend on the batch it runs in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402

TOL = 1e-5
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
PROMPT = [5, 17, 42, 99, 7, 7, 250, 31, 64, 12]
SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, frequency_penalty=0.4,
                presence_penalty=0.3, logit_bias={3: 2.5, 7: -1.0}, seed=1234, max_tokens=8, logprobs=3,
                ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=256, seed=0)


def processed_logits(logits: torch.Tensor, prompt: list[int], out: list[int], sp: dict) -> torch.Tensor:
    """The processing of one row, plainly: bias, penalties, temperature, top-k, top-p (float32 [V])."""
    x = logits.clone()
    for tok, bias in sp["logit_bias"].items():
        x[tok] += bias
    for tok in set(prompt) | set(out):  # repetition (HF): seen anywhere
        x[tok] = x[tok] / sp["repetition_penalty"] if x[tok] > 0 else x[tok] * sp["repetition_penalty"]
    for tok in set(out):  # frequency / presence (OpenAI): generated tokens only
        x[tok] -= sp["frequency_penalty"] * out.count(tok) + sp["presence_penalty"]
    x = x / sp["temperature"]
    kth = torch.sort(x, descending=True).values[sp["top_k"] - 1]
    x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    order = torch.argsort(probs, descending=True)
    mass_before = torch.cumsum(probs[order], dim=0) - probs[order]
    drop = order[mass_before >= sp["top_p"]]  # nucleus: the first token whose mass before reaches top_p goes
    x[drop] = float("-inf")
    return x


def reference_values(hf_model, prompt: list[int], out: list[int], mode: str, sp: dict) -> list[torch.Tensor]:
    """Per generated position t: the values [V] the engine must report for mode (from prompt + out[:t])."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 :].float()
    rows = []
    for t in range(len(out)):
        x = logits[t] if mode.startswith("raw") else processed_logits(logits[t], prompt, out[:t], sp)
        rows.append(x if mode.endswith("logits") else torch.log_softmax(x, dim=-1))
    return rows


def _check_against_reference(completion, ref_rows, k: int) -> None:
    assert len(completion.logprobs) == len(completion.token_ids) == len(ref_rows)
    for tok, lps, ref in zip(completion.token_ids, completion.logprobs, ref_rows):
        assert torch.isfinite(ref[tok]), "the sampled token survived the processing"
        assert abs(lps[tok].logprob - ref[tok].item()) <= TOL, (lps[tok].logprob, ref[tok].item())
        top_vals, top_ids = ref.topk(k)
        for tid, val in zip(top_ids.tolist(), top_vals.tolist()):
            assert tid in lps and abs(lps[tid].logprob - val) <= TOL, (tid, val, lps.get(tid))


@pytest.mark.parametrize("mode", MODES)
def test_sampled_token_logprobs_equal_plain_torch(llm, hf_model, mode):
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(logprobs_mode=mode, **SAMPLING),
                       use_tqdm=False)[0].outputs[0]
    _check_against_reference(out, reference_values(hf_model, PROMPT, list(out.token_ids), mode, SAMPLING),
                             SAMPLING["logprobs"])


def test_engine_logprobs_mode_is_the_default(tiny_llama_dir, hf_model):
    """LLM(logprobs_mode=...) applies to requests that do not set one; prompt logprobs stay raw."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=256, seed=0,
              logprobs_mode="processed_logits")
    res = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(prompt_logprobs=1, **SAMPLING),
                       use_tqdm=False)[0]
    out = res.outputs[0]
    _check_against_reference(out, reference_values(hf_model, PROMPT, list(out.token_ids), "processed_logits",
                                                   SAMPLING), SAMPLING["logprobs"])
    with torch.no_grad():
        raw = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    for i in range(1, len(PROMPT)):
        assert abs(res.prompt_logprobs[i][PROMPT[i]].logprob - raw[i - 1, PROMPT[i]].item()) <= TOL
    with pytest.raises(ValueError, match="logprobs_mode"):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=64, logprobs_mode="processed")


def _others(n: int) -> list[tuple[list[int], SamplingParams]]:
    """n different requests: other prompts and lengths, greedy and sampled, other modes and filters."""
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i in range(n):
        prompt = torch.randint(3, 300, (int(torch.randint(2, 40, (1,), generator=g)),), generator=g).tolist()
        sp = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.5 + 0.1 * i, top_k=-1 if i % 2 else 10,
                            min_p=0.02 * (i % 2), seed=i, max_tokens=4 + i, logprobs=i % 4,
                            logprobs_mode=MODES[i % 4], repetition_penalty=1.0 + 0.1 * (i % 3), ignore_eos=True)
        reqs.append((prompt, sp))
    return reqs


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_are_batch_invariant(llm, mode):
    target = ({"prompt_token_ids": PROMPT}, SamplingParams(logprobs_mode=mode, **SAMPLING))
    alone = llm.generate([target[0]], [target[1]], use_tqdm=False)[0].outputs[0]
    others = _others(7)
    batch = [target] + [({"prompt_token_ids": p}, sp) for p, sp in others]
    for order in (batch, batch[::-1]):  # first and last in the batch
        outs = llm.generate([b[0] for b in order], [b[1] for b in order], use_tqdm=False)
        got = outs[0 if order is batch else len(order) - 1].outputs[0]
        assert list(got.token_ids) == list(alone.token_ids)
        for a, b in zip(alone.logprobs, got.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) <= TOL for t in a)
