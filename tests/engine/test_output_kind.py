"""SamplingParams.output_kind (vLLM's RequestOutputKind): FINAL_ONLY requests come out of LLMEngine.step only when
finished, with exactly the final output a CUMULATIVE request gets; LLM.generate asks for FINAL_ONLY on its own clones
(the caller's SamplingParams unchanged) and returns what it returned before; bad values are refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from pagellm import LLM, RequestOutputKind, SamplingParams  # noqa: E402

PROMPTS = [[5, 9, 14, 3, 7], [11, 2, 8], [4, 4, 6, 19, 23, 1, 30]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="bfloat16", max_model_len=128, num_kv_blocks=256, seed=0)


def _summary(out):
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in out.outputs]


def _run(eng, kind: RequestOutputKind, tag: str, **kw) -> dict[str, list]:
    """Every output step() returned per request, in order."""
    for i, p in enumerate(PROMPTS):
        sp = SamplingParams(max_tokens=6 + 3 * i, output_kind=kind, **kw)
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, sp)
    seen: dict[str, list] = {f"{tag}-{i}": [] for i in range(len(PROMPTS))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("kw", [dict(temperature=0.0, ignore_eos=True),
                                dict(temperature=0.8, seed=7, n=2, logprobs=2, ignore_eos=True),
                                dict(temperature=0.0, stop=["a"])],
                         ids=["greedy", "seeded_n2_logprobs", "stop_string"])
def test_final_only_returns_just_the_final_output(llm, kw):
    eng = llm.llm_engine
    cumulative = _run(eng, RequestOutputKind.CUMULATIVE, "cum", **kw)
    final = _run(eng, RequestOutputKind.FINAL_ONLY, "fin", **kw)
    for i in range(len(PROMPTS)):
        cum, fin = cumulative[f"cum-{i}"], final[f"fin-{i}"]
        assert all(not o.finished for o in cum[:-1]) and cum[-1].finished
        assert len(cum) > 1 or not kw.get("ignore_eos")  # CUMULATIVE: one output per step that changed it
        assert len(fin) == 1 and fin[0].finished
        assert _summary(fin[0]) == _summary(cum[-1])
        assert fin[0].metrics.num_generation_tokens == cum[-1].metrics.num_generation_tokens > 0


def test_generate_uses_final_only_on_its_own_clones(llm, monkeypatch):
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    before = [_summary(o) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    built = []
    real_add = eng.add_request

    def spy(request_id, prompt, params, **kwargs):
        built.append(params.output_kind)
        return real_add(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(eng, "add_request", spy)
    after = [_summary(o) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]
    assert built == [RequestOutputKind.FINAL_ONLY] * len(PROMPTS)
    assert sp.output_kind == RequestOutputKind.CUMULATIVE  # the caller's object untouched
    assert after == before
    # greedy: the first 6 tokens of prompt 0 are those of a 6-token CUMULATIVE run through the engine
    cum = _run(eng, RequestOutputKind.CUMULATIVE, "gen", temperature=0.0, ignore_eos=True)
    assert after[0][0][0][:6] == _summary(cum["gen-0"][-1])[0][0]


@pytest.mark.parametrize("bad", [1, 3, -1, True, 2.0, "final_only", None])
def test_bad_output_kind_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=bad)


def test_output_kind_accepts_the_enum_values_as_ints():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
