import math

import pytest
import torch

from pagellm.sampling import (Sampler, SamplingRow, apply_min_p, apply_top_k_top_p, build_sampling_metadata)
from pagellm.sampling.processors import SMALL_ROWS
from pagellm.sampling.sampler import argmax_rows
from pagellm.sampling_params import SamplingParams

V = 50


def _row(prompt=(1, 2), out=(), seed=None, **kw):
    p = SamplingParams(seed=seed, **kw)
    p.update_from_generation_config([0])
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(p, list(prompt), list(out), gen)


def _sample(logits, rows, gen_seed=0):
    md = build_sampling_metadata(rows, logits.shape[1])
    return Sampler(torch.Generator().manual_seed(gen_seed))(logits, md)


def ref_penalties(logits, prompt, out, rep, freq, pres):
    logits = logits.clone()
    seen = set(prompt) | set(out)
    for t in seen:
        if rep != 1.0:
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(out):
        c = out.count(t)
        logits[t] -= freq * c + pres
    return logits


def test_penalties_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 3
    specs = [
        dict(prompt=[1, 2, 3], out=[3, 3, 4, 7], repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7),
        dict(prompt=[9, 10], out=[], repetition_penalty=0.8),
        dict(prompt=[5], out=[5, 6, 6, 6], frequency_penalty=-0.4, presence_penalty=1.1),
    ]
    rows = [_row(s["prompt"], s["out"], temperature=0.0, **{k: v for k, v in s.items() if k not in ("prompt", "out")})
            for s in specs]
    md = build_sampling_metadata(rows, V)
    from pagellm.sampling.sampler import apply_penalties

    got = apply_penalties(logits.clone(), md)
    for i, s in enumerate(specs):
        ref = ref_penalties(logits[i], s["prompt"], s["out"], s.get("repetition_penalty", 1.0),
                            s.get("frequency_penalty", 0.0), s.get("presence_penalty", 0.0))
        torch.testing.assert_close(got[i], ref)


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 5, 5]), torch.tensor([1.0, 0.7, 0.85]))
    kept = (out > -math.inf).tolist()
    assert kept[0] == [True, True, False, False, False]  # top-2
    assert kept[1] == [True, True, False, False, False]  # 0.5 + 0.2 >= 0.7
    assert kept[2] == [True, True, True, False, False]  # 0.85
    mp = apply_min_p(logits[:1].clone(), torch.tensor([0.3]))  # threshold 0.15
    assert (mp > -math.inf).tolist() == [[True, True, True, False, False]]


def test_sampling_respects_masks_empirically():
    logits = torch.randn(1, V)
    rows = [_row(temperature=1.0, top_k=3, seed=i) for i in range(200)]
    toks = _sample(logits.expand(200, V).clone(), rows).sampled_token_ids
    assert set(toks.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(toks.tolist())) == 3


def test_greedy_is_argmax_and_min_tokens_masks_eos():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    logits[1, 0] = 100.0  # EOS (id 0) would win
    rows = [_row(temperature=0.0), _row(temperature=0.0, min_tokens=2, out=[5]), _row(temperature=0.0),
            _row(temperature=0.0, logit_bias={7: 100.0})]
    toks = _sample(logits, rows).sampled_token_ids.tolist()
    assert toks[0] == logits[0].argmax().item() and toks[2] == logits[2].argmax().item()
    assert toks[1] != 0
    assert toks[3] == 7


@pytest.mark.parametrize("path", ["op", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [7, 511, 512, 1000, 4097])
def test_argmax_rows_matches_torch_argmax(dtype, v, path, monkeypatch):
    """Both CPU paths: the compiled argmax_rows op, and the pure-torch fallback used without it."""
    import pagellm.sampling.processors as processors

    if path == "torch":
        monkeypatch.setattr(processors, "_argmax_op", lambda: None)
    elif processors._argmax_op() is None:
        pytest.skip("pagellm._C is not built: no argmax_rows op")
    g = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=g).to(dtype)
    x[1] = torch.randint(0, 3, (v,), generator=g).to(dtype)  # many ties: the first index must win
    x[2, -1] = 50.0  # the maximum in the last (possibly short) block
    x[3, 0] = 50.0
    x[4, v // 2] = float("nan")  # NaN counts as the maximum, as in torch.argmax
    x[5] = float("-inf")
    x[6, v // 3] = float("inf")
    x[7, v - 1] = x[7, v // 5] = 60.0  # tie between blocks
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, : v - 1] if v > 1 else x), (x[:, : v - 1] if v > 1 else x).argmax(-1))
    assert argmax_rows(x[:0]).shape == (0,)
    many = x.repeat(3, 1)  # more rows than SMALL_ROWS: the blocked path (9 rows take the row-by-row one)
    assert many.shape[0] > SMALL_ROWS >= x.shape[0]
    assert torch.equal(argmax_rows(many), many.argmax(dim=-1))
    for i in range(x.shape[0]):  # one row at a time: the batch-1 path
        assert torch.equal(argmax_rows(x[i : i + 1]), x[i : i + 1].argmax(dim=-1))


def test_greedy_bf16_logits_sample_as_float32():
    """The greedy fast path takes model-dtype logits as they are; the general path widens them."""
    torch.manual_seed(4)
    logits = torch.randn(3, 3000).bfloat16()
    rows = [_row(temperature=0.0) for _ in range(3)]
    assert _sample(logits, rows).sampled_token_ids.tolist() == logits.float().argmax(-1).tolist()
    rows = [_row(temperature=0.0, logprobs=2) for _ in range(3)]
    out = _sample(logits, rows)
    assert out.sampled_token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.logprobs.logprobs.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], ref.max(-1).values)


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(2)
    target = torch.randn(V)

    def run(batch_size, pos, other_seed):
        logits = torch.randn(batch_size, V)
        logits[pos] = target
        rows = [_row(temperature=1.0, seed=other_seed + i) if i % 2 else _row(temperature=0.7) for i in range(batch_size)]
        rows[pos] = _row(temperature=0.9, top_p=0.9, seed=1234)
        sampler = Sampler(torch.Generator().manual_seed(other_seed))
        toks = []
        for _ in range(20):  # same generator consumed across steps
            md = build_sampling_metadata(rows, V)
            toks.append(sampler(logits, md).sampled_token_ids[pos].item())
        return toks

    a = run(1, 0, 0)
    assert a == run(7, 3, 99) == run(32, 31, 5)
    assert len(set(a)) > 1


def test_logprobs_raw_vs_processed():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    rows = [_row(temperature=0.5, top_k=5, logprobs=3, seed=1),
            _row(temperature=0.5, top_k=5, logprobs=3, seed=1, logprobs_mode="processed")]
    out = _sample(logits, rows)
    lt = out.logprobs
    raw = torch.log_softmax(logits, -1)
    tok = out.sampled_token_ids
    assert lt.token_ids.shape == (2, 4)
    torch.testing.assert_close(lt.logprobs[0, 0], raw[0, tok[0]])
    torch.testing.assert_close(lt.logprobs[0, 1:], raw[0].topk(3).values)
    assert lt.ranks[0, 0].item() == int((raw[0] > raw[0, tok[0]]).sum()) + 1
    masked = logits[1] / 0.5
    kth = masked.topk(5).values[-1]
    proc = torch.log_softmax(masked.masked_fill(masked < kth, -math.inf), -1)
    torch.testing.assert_close(lt.logprobs[1, 0], proc[tok[1]])
    torch.testing.assert_close(lt.logprobs[1, 1:], proc.topk(3).values)
    assert torch.isclose(lt.logprobs[1, 1:].exp().sum(), torch.tensor(1.0), atol=0.5)


def test_distribution_matches_probs():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    rows = [_row(temperature=1.0)] * 4000
    toks = _sample(logits.expand(4000, 3).clone(), rows).sampled_token_ids
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.04)
