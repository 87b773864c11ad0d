"""`pagellm train-medusa --data distill` on a tiny random Llama (fp32): the prompts (medusa_prompts.py: seeded,
varied, the held-out set disjoint from training and neither holding a benchmark chat question), the recorder
(medusa_distill.py: answering with it changes no token, the states it keeps are the model's final hidden states at
every answer position, the greedy labels of a sampled answer are the model's argmax), the data layout, and the
trainer's label_ids path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from test_draft_tokens import _generate, _greedy, _make_llm, _tie_free_prompts  # noqa: E402

from pagellm import SamplingParams  # noqa: E402
from pagellm.spec_decode.medusa_chat_data import chat_prompt_ids  # noqa: E402
from pagellm.spec_decode.medusa_distill import greedy_labels, record_answers  # noqa: E402
from pagellm.spec_decode.medusa_heads import MedusaHeads  # noqa: E402
from pagellm.spec_decode.medusa_prompts import KINDS, distill_prompts, doc_paragraphs, source_functions  # noqa: E402
from pagellm.spec_decode.medusa_train import MedusaTrainConfig, head_targets, train_heads  # noqa: E402
from pagellm.spec_decode.medusa_train_data import distill_training_data, final_hidden_states  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def hf_base(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def prompts_300():
    return distill_prompts(300, held_out=False, seed=5), distill_prompts(60, held_out=True, seed=5)


def test_prompts_are_seeded_varied_and_disjoint_from_the_held_out_and_bench_sets(prompts_300):
    train, held = prompts_300
    assert len(train) == 300 and len(set(train)) == 300 and len(held) == 60
    assert train == distill_prompts(300, held_out=False, seed=5)
    assert train != distill_prompts(300, held_out=False, seed=6)
    assert not set(train) & set(held)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from spec_workloads import CHAT_QUESTIONS  # the chat prompts bench_spec_decode runs
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert not set(CHAT_QUESTIONS) & (set(train) | set(held))
    code = [p for p in train if "```python" in p or p.startswith("Write a Python function")]
    docs = [p for p in train if "Python doc" in p or "Python docs" in p or "beginner programmer" in p]
    if not source_functions(False)[:1] or not doc_paragraphs(False)[:1]:
        pytest.skip("python3.11-doc or /usr/lib/python3.11 sources missing: only chat prompts")
    assert len(code) > 30 and len(docs) > 20  # the mix holds every kind, open chat the largest
    assert len(train) - len(code) - len(docs) > 150 and len(KINDS) == 4
    held_code = {p for p in held if "```python" in p}
    assert not {p.split("```python")[1] for p in held_code} & {p.split("```python")[1] for p in code if "```" in p}


def test_recording_changes_no_token_and_keeps_the_models_hidden_states(tiny_llama_dir, tiny_tokenizer, hf_base):
    prompts = _tie_free_prompts(tiny_llama_dir, len(tiny_tokenizer), _greedy(16), lens=[5, 9, 7, 12], seed=4)
    plain = [o.token_ids for o in _generate(_make_llm(tiny_llama_dir), prompts, SamplingParams(temperature=0.0,
                                                                                                max_tokens=16))]
    llm = _make_llm(tiny_llama_dir)
    seqs = record_answers(llm, prompts, 16, say=lambda _m: None, chunk=3)  # two chunks
    assert llm.llm_engine.proposer is None  # the recorder is gone again
    for p, s, ref in zip(prompts, seqs, plain):
        assert s.token_ids == p + list(ref) and s.prompt_len == len(p) and s.label_ids == s.token_ids
        want = final_hidden_states(hf_base, torch.tensor([s.token_ids]))[0]
        first, last = len(p) - 1, len(s.token_ids) - 2  # the last state (after the final token) is never kept
        torch.testing.assert_close(s.hidden[first:last], want[first:last], atol=1e-4, rtol=1e-4)
        assert bool((s.hidden[:first] == 0).all()) and s.hidden.dtype == torch.float32  # the engine's dtype
        # the engine's own LM head over the kept states gives back the greedy answer
        model = llm.llm_engine.model
        assert greedy_labels(s.token_ids, len(p), s.hidden, model.compute_logits) == s.token_ids


def test_sampled_answers_are_labelled_with_the_models_greedy_choice(tiny_llama_dir, tiny_tokenizer, hf_base):
    prompts = _tie_free_prompts(tiny_llama_dir, len(tiny_tokenizer), _greedy(16), lens=[6, 8, 10], seed=7)
    llm = _make_llm(tiny_llama_dir)
    seqs = record_answers(llm, prompts, 20, temperature=1.5)
    differ = same = total = 0
    for s in seqs:
        logits = hf_base(torch.tensor([s.token_ids])).logits[0]
        argmax = logits.argmax(-1).tolist()  # argmax[j] follows token j
        for j in range(s.prompt_len, len(s.token_ids) - 1):  # the last token's state is not kept
            total, same = total + 1, same + (s.label_ids[j] == argmax[j - 1])
            differ += s.label_ids[j] != s.token_ids[j]
    assert total > 30 and differ > 0  # hot sampling left the greedy path
    assert same >= 0.97 * total, (same, total)  # bf16 state rounding may flip a near-tie


def test_distill_data_keeps_answers_from_the_prompts_last_token(tiny_llama_dir, tiny_tokenizer):
    from pagellm.entrypoints.train_medusa import engine_recorder

    calls = []
    real = engine_recorder(str(tiny_llama_dir), "float32", 8, lambda _m: None)

    def record(prompts, answer_len, temperature):
        calls.append((len(prompts), temperature))
        return real(prompts, answer_len, temperature)

    config = MedusaTrainConfig(data="distill", seq_len=10, num_train_seqs=8, num_heads=2, sampled_fraction=0.25)
    ids, hidden, pos, labels = distill_training_data(tiny_tokenizer, config, False, lambda _m: None, record)
    assert calls == [(6, 0.0), (2, config.sample_temperature)]
    prompts = chat_prompt_ids(tiny_tokenizer, distill_prompts(8, False, config.seed))
    greedy = real(prompts[2:3], 10, 0.0)[0]  # the first greedy answer, laid first
    segment = greedy.token_ids[greedy.prompt_len - 1 :]
    assert ids[0, : len(segment)].tolist() == segment and labels.shape == ids.shape
    assert hidden.shape[:2] == ids.shape and hidden.dtype == torch.bfloat16
    assert int(pos[0]) == 0 and bool((hidden[0, pos].abs().sum(-1) > 0).all())  # every trained state was kept
    with pytest.raises(ValueError, match="record_fn"):
        distill_training_data(tiny_tokenizer, config, False, lambda _m: None, None)


def test_train_heads_learns_the_label_ids():
    torch.manual_seed(0)
    hidden, ids = torch.randn(2, 40, 16), torch.randint(0, 32, (2, 40))
    weight = torch.randn(32, 16)
    config = MedusaTrainConfig(steps=6, batch_size=32, lr=1e-2, warmup_steps=1, num_heads=2)

    def run(label_ids):
        heads = MedusaHeads(16, 32, num_heads=2)
        return train_heads(heads, lambda x: x @ weight.t(), hidden, ids, config, label_ids=label_ids)

    assert run(None) == run(ids.clone())  # the text's own tokens as labels: the same training
    other = (ids + 1) % 32
    assert run(other) != run(None)
    flat, labels = head_targets(other, 2)
    assert torch.equal(labels[:, 0], other.reshape(-1)[flat + 2])


def test_bad_distill_settings_are_refused():
    for bad in ({"sampled_fraction": 1.5}, {"sample_temperature": 0.0}, {"tree_row_cost": -1.0}):
        with pytest.raises(ValueError):
            MedusaTrainConfig(data="distill", **bad).check()
    with pytest.raises(ValueError, match="answer_len"):
        record_answers(None, [[1, 2]], 0)
