"""The per-step host path's fast paths give what the general paths give (issue 22, session 16):

* top-k / top-p by value thresholds (sampling/top_k_top_p.py) == the index sort, bit for bit, on random rows with
  bf16-style ties at odd vocabulary sizes; both branches (threshold, sorted fallback) are exercised;
* the engine's plain-greedy path (no SamplingRow, no metadata) and the sampler's top-k / top-p path give the same
  tokens, text and logprobs as the general paths for the same seeds: greedy, seeded top-k / top-p / both / min-p,
  n = 2, logprobs, stop strings;
* the detokenizer's direct Rust decode == the tokenizer's decode, and text deltas are unchanged;
* the decode graphs' persistent padded block tables hold exactly the scheduler's table, zero-padded.
"""

from __future__ import annotations

import pytest
import torch

from pagellm.sampling import top_k_top_p as tktp

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, SamplingParams  # noqa: E402


def _random_case(g: torch.Generator, n: int, v: int, case: int):
    scale = (0.5, 3.0, 12.0)[case % 3]
    x = (torch.randn(n, v, generator=g) * scale).to(torch.bfloat16).float() / (1.0, 0.7, 1.3)[case % 3]
    top_k = torch.randint(1, max(2, v // 3), (n,), generator=g) if case % 4 else None
    if top_k is not None and case % 7 == 0:
        top_k[0] = v  # top-k off for one row of the batch (the sampler passes vocab_size)
    top_p = torch.rand(n, generator=g) * 0.9 + 0.1 if case % 4 != 1 else None
    if top_p is not None and case % 6 == 0:
        top_p[0] = 1.0
    if case % 11 == 5:
        x[0, : v // 2] = float("-inf")  # a min-p / bias-style mask before the filters
    return x, top_k, top_p


@pytest.mark.parametrize("v", [37, 1000, 4099])
def test_top_k_top_p_by_value_equals_sorted(monkeypatch, v):
    calls = {"sorted": 0}
    sorted_path = tktp.apply_top_k_top_p_sorted

    def counting(*args):
        calls["sorted"] += 1
        return sorted_path(*args)

    monkeypatch.setattr(tktp, "apply_top_k_top_p_sorted", counting)
    g = torch.Generator().manual_seed(v)
    num_cases = 0
    for case in range(120):
        x, top_k, top_p = _random_case(g, 1 + case % 5 + (40 if case % 13 == 0 else 0), v, case)
        if top_k is None and top_p is None:
            continue
        num_cases += 1
        want = sorted_path(x.clone(), top_k, top_p)
        got = tktp.apply_top_k_top_p(x.clone(), top_k, top_p)
        assert torch.equal(got, want), (v, case)
    # both branches ran: value thresholds for most rows, the index sort for rows whose nucleus cut splits tied values
    assert 0 < calls["sorted"] < num_cases


def test_top_k_top_p_nan_and_other_dtypes_take_the_sorted_path():
    x = torch.randn(3, 300)
    x[1, 7] = float("nan")  # only row 1 sorts; rows 0 and 2 by thresholds
    top_k, top_p = torch.tensor([5, 9, 40]), torch.tensor([0.8, 0.5, 0.9])
    torch.testing.assert_close(tktp.apply_top_k_top_p(x.clone(), top_k, top_p),
                               tktp.apply_top_k_top_p_sorted(x.clone(), top_k, top_p), rtol=0, atol=0, equal_nan=True)
    xd = torch.randn(3, 200, dtype=torch.float64)
    assert torch.equal(tktp.apply_top_k_top_p(xd, top_k.repeat(2)[:3], None),
                       tktp.apply_top_k_top_p_sorted(xd, top_k.repeat(2)[:3], None))


# ------------------------------------------------------------------------------------------------ the engine
PROMPTS = [[5, 17, 42, 99, 7], [250, 31, 64, 12, 8, 9, 10], [3, 4]]
PARAMS = {
    "greedy": dict(temperature=0.0),
    "greedy_logprobs": dict(temperature=0.0, logprobs=3),
    "top_k": dict(temperature=0.9, top_k=20, seed=11),
    "top_p": dict(temperature=1.1, top_p=0.8, seed=12),
    "top_k_top_p": dict(temperature=0.7, top_k=50, top_p=0.9, seed=13, logprobs=2),
    "min_p_top_p": dict(temperature=1.0, min_p=0.05, top_p=0.95, seed=14),
    "n2": dict(temperature=0.8, top_p=0.9, top_k=30, n=2, seed=15),
    "unseeded": dict(temperature=0.9, top_k=25, top_p=0.85),
    "stop": dict(temperature=0.0, stop=["a", "e"]),
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # bfloat16: bf16 logits have many exact ties, so the sorted fallback runs too
    return LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=128, num_kv_blocks=256, seed=0)


def _generate(llm: LLM, kw: dict):
    sp = SamplingParams(max_tokens=24, ignore_eos=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
              None if c.logprobs is None else [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()}
                                               for d in c.logprobs]) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_fast_paths_give_the_general_paths_tokens(llm, monkeypatch, name):
    """Same engine seed and request seeds: the fast paths (this session) against the general ones (forced)."""
    import pagellm.engine.detokenizer as detok
    import pagellm.engine.output_processor as op
    import pagellm.sampling.processors as proc

    eng = llm.llm_engine
    eng.sampler.generator.manual_seed(0)  # unseeded rows draw from the engine's generator: start both runs alike
    fast = _generate(llm, PARAMS[name])
    monkeypatch.setattr(op, "is_plain_greedy", lambda p: False)
    monkeypatch.setattr(proc, "apply_top_k_top_p", tktp.apply_top_k_top_p_sorted)
    monkeypatch.setattr(detok, "backend_decoder", lambda tok: None)
    eng.sampler.generator.manual_seed(0)
    general = _generate(llm, PARAMS[name])
    assert fast == general
    assert all(len(c[0]) > 0 for o in fast for c in o)


def _count_metadata_builds(monkeypatch, module) -> list[int]:
    """`module.build_sampling_metadata` wrapped: the returned list gets each call's number of rows."""
    built: list[int] = []
    real = module.build_sampling_metadata

    def counting(rows, *args, **kwargs):
        built.append(len(rows))
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(module, "build_sampling_metadata", counting)
    return built


def test_plain_greedy_skips_the_sampling_metadata(llm, monkeypatch):
    import pagellm.engine.sample_step as le

    built = _count_metadata_builds(monkeypatch, le)
    _generate(llm, PARAMS["greedy"])
    assert built == []
    _generate(llm, PARAMS["greedy_logprobs"])  # logprobs: the general path
    assert built and all(n >= 1 for n in built)


def test_backend_decoder_matches_decode(tiny_tokenizer):
    from pagellm.engine.detokenizer import IncrementalDetokenizer, backend_decoder, decode_tokens

    fast = backend_decoder(tiny_tokenizer)
    assert fast is not None  # the tests' tokenizer is transformers' own fast class
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, len(tiny_tokenizer), (400,), generator=g).tolist()
    for skip in (True, False):
        for i in range(0, len(ids), 9):
            assert fast(ids[i : i + 9], skip_special_tokens=skip) == decode_tokens(tiny_tokenizer, ids[i : i + 9], skip)
    d = IncrementalDetokenizer(tiny_tokenizer, ids[:5])
    deltas = "".join(d.update([t]) for t in ids[5:]) + d.flush()
    assert deltas == d.output_text and len(deltas) > 0


def test_backend_decoder_refuses_overridden_decode(tiny_tokenizer):
    from pagellm.engine.detokenizer import backend_decoder

    class Custom(type(tiny_tokenizer)):
        def _decode(self, token_ids, **kwargs):  # a model-specific decode must be honoured
            return "x"

    tok = Custom(tokenizer_object=tiny_tokenizer.backend_tokenizer)
    assert backend_decoder(tok) is None
    assert backend_decoder(object()) is None


def test_padded_tables_buffer_is_reused_and_exact(llm):
    runner = llm.llm_engine.runner
    g = torch.Generator().manual_seed(5)
    seen = {}
    for width in (3, 5, 2, 7, 3):
        tables = torch.randint(1, 100, (4, width), generator=g, dtype=torch.int32)
        out = runner._pad_tables(tables, 8, 0)
        assert out.shape == (4, 8) and torch.equal(out[:, :width], tables) and not out[:, width:].any()
        seen.setdefault(id(out), 0)
    assert len(seen) == 1  # one buffer for (4 rows, 8 columns)
    same = torch.ones(2, 8, dtype=torch.int32)
    assert runner._pad_tables(same, 8, 0) is same  # already the padded width: no copy


# ------------------------------------------------------------------------------- plain-greedy verify steps
def test_greedy_verify_without_metadata_equals_general():
    """verify_drafts with plain_greedy_metadata (no per-row tensors) accepts what the general greedy metadata
    accepts: bf16 logits with ties, drafts agreeing with the argmax for a random prefix, k = 0..6 per row."""
    from pagellm.sampling import SamplingRow, build_sampling_metadata, expand_rows_for_verify
    from pagellm.sampling.metadata import plain_greedy_metadata
    from pagellm.sampling.rejection import verify_drafts

    g = torch.Generator().manual_seed(3)
    accepted = 0
    for case in range(40):
        vocab = (37, 1000, 4099)[case % 3]
        ks = torch.randint(0, 7, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        n = sum(1 + k for k in ks)
        logits = (torch.randn(n, vocab, generator=g) * 2).to(torch.bfloat16)
        target = logits.float().argmax(dim=1).tolist()
        drafts, start = [], 0
        for k in ks:
            agree = int(torch.randint(0, k + 1, (1,), generator=g))
            row = [target[start + j] if j < agree else (target[start + j] + 1) % vocab for j in range(k)]
            drafts.append(row)
            start += k + 1
        params = SamplingParams(temperature=0.0)
        rows = [SamplingRow(params, [1, 2], [3]) for _ in ks]
        general = verify_drafts(logits, drafts, build_sampling_metadata(expand_rows_for_verify(rows, drafts), vocab))
        fast = verify_drafts(logits, drafts, plain_greedy_metadata(n, vocab))
        assert fast.accepted_token_ids == general.accepted_token_ids
        assert fast.num_accepted_tokens == general.num_accepted_tokens and fast.logprobs is None
        accepted += sum(len(a) - 1 for a in fast.accepted_token_ids)
    assert accepted > 0  # some drafts were accepted, not only first-position rejections


@pytest.mark.parametrize("wrong", [None, 0.4])
def test_plain_greedy_spec_steps_skip_the_metadata(tiny_llama_dir, tiny_tokenizer, monkeypatch, wrong):
    """A speculative engine whose rows are all plain greedy verifies without SamplingRows or metadata, and gives
    the tokens of the general verify path (forced), with drafts both accepted and rejected."""
    import pagellm.engine.output_processor as op
    import pagellm.engine.spec_step as ss
    from test_draft_tokens import OracleProposer, _generate, _greedy, _make_llm, _reference

    prompts = [[5, 17, 42, 99, 7], [250, 31, 64, 12, 8, 9, 10], [3, 4]]
    _, reference, _ = _reference(tiny_llama_dir, prompts, _greedy(20))
    built = _count_metadata_builds(monkeypatch, ss)
    results = {}
    for general in (False, True):
        if general:
            monkeypatch.setattr(op, "is_plain_greedy", lambda p: False)
        llm = _make_llm(tiny_llama_dir)
        eng = llm.llm_engine
        eng.set_proposer(OracleProposer(3, reference, len(tiny_tokenizer), p_wrong=wrong or 0.0, seed=1, strict=False))
        built.clear()
        results[general] = [o.token_ids for o in _generate(llm, prompts, _greedy(20))]
        stats = eng.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_draft_tokens > 0
        assert (stats.num_accepted_draft_tokens < stats.num_draft_tokens) == bool(wrong)
        assert (built == []) != general  # the general path builds per-position metadata, the fast path none
    assert results[False] == results[True]
    assert results[False] == [reference[tuple(p)] for p in prompts]
