"""lm-eval's "pagellm" model type against lm-eval's own `hf` backend on the same tiny fp32 Llama
(tests/conftest.py), over three tasks this test writes as local YAML + jsonl files (no downloads):
multiple-choice loglikelihood, loglikelihood_rolling perplexity (several windows per document), and
generate_until with stop strings."""

from __future__ import annotations

import json
import math
import random

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the optional [eval] extra (pip install 'pagellm[eval]')")
pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
pytest.importorskip("accelerate", reason="lm-eval's hf backend (the reference) imports accelerate")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import pagellm.eval  # noqa: E402,F401 (registers the "pagellm" model type)

MAX_LENGTH = 40  # both backends: documents of ~100 tokens span several rolling windows
WORDS = ("the quick brown fox jumps over lazy dog sea wide deep blue engine could once upon time there was "
         "little tell me about main return café naïve world").split()

MC_YAML = """task: pagellm_test_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """task: pagellm_test_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """task: pagellm_test_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [".", "\\n\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _write_tasks(root) -> None:
    rng = random.Random(0)
    docs = {
        "mc": [{"question": _sentence(rng, 6), "choices": [" " + _sentence(rng, rng.randint(1, 4)) for _ in range(4)],
                "label": rng.randrange(4)} for _ in range(12)],
        "ppl": [{"text": _sentence(rng, rng.randint(40, 90)) + "."} for _ in range(4)],
        "gen": [{"prompt": _sentence(rng, rng.randint(3, 10)), "answer": _sentence(rng, 2)} for _ in range(5)],
    }
    for name, yaml in (("mc", MC_YAML), ("ppl", PPL_YAML), ("gen", GEN_YAML)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs[name]))
        (root / f"{name}.yaml").write_text(yaml.format(data=data))


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    _write_tasks(root)
    return root


def _evaluate(model: str, model_args: dict, task_manager: TaskManager) -> dict:
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["pagellm_test_mc", "pagellm_test_ppl", "pagellm_test_gen"],
        task_manager=task_manager, batch_size=1, device="cpu", log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


@pytest.fixture(scope="module")
def both_results(tiny_llama_dir, task_dir):
    args = {"pretrained": str(tiny_llama_dir), "dtype": "float32", "max_length": MAX_LENGTH}
    # only this test's tasks: indexing lm-eval's thousands of built-in task files takes seconds
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    ours = _evaluate("pagellm", args, tasks)
    theirs = _evaluate("hf", args, tasks)
    return ours, theirs


def _per_sample(results: dict, task: str) -> list:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_multiple_choice_matches_hf(both_results):
    ours, theirs = both_results
    for metric in ("acc,none", "acc_norm,none"):
        a, b = ours["results"]["pagellm_test_mc"][metric], theirs["results"]["pagellm_test_mc"][metric]
        assert abs(a - b) * 12 <= 1 + 1e-9, (metric, a, b)  # within one item
    for s_ours, s_hf in zip(_per_sample(ours, "pagellm_test_mc"), _per_sample(theirs, "pagellm_test_mc")):
        for (lp_ours, greedy_ours), (lp_hf, greedy_hf) in zip(
                [r[0] for r in s_ours["resps"]], [r[0] for r in s_hf["resps"]]):
            assert math.isclose(lp_ours, lp_hf, rel_tol=1e-4, abs_tol=1e-4), (lp_ours, lp_hf)


def test_perplexity_matches_hf(both_results, tiny_tokenizer):
    ours, theirs = both_results
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        a, b = ours["results"]["pagellm_test_ppl"][metric], theirs["results"]["pagellm_test_ppl"][metric]
        assert math.isclose(a, b, rel_tol=1e-4), (metric, a, b)
    # the documents were long enough to need several windows of MAX_LENGTH tokens
    assert all(len(tiny_tokenizer.encode(s["doc"]["text"])) > 2 * MAX_LENGTH
               for s in _per_sample(ours, "pagellm_test_ppl"))


def test_generate_until_matches_hf(both_results):
    ours, theirs = both_results
    gens_ours = [s["resps"][0][0] for s in _per_sample(ours, "pagellm_test_gen")]
    gens_hf = [s["resps"][0][0] for s in _per_sample(theirs, "pagellm_test_gen")]
    assert gens_ours == gens_hf
    assert any(g.strip() for g in gens_ours)
    assert not any("." in g for g in gens_ours)  # cut at the stop string


def test_registered_and_bad_arguments_refused_before_loading(tmp_path):
    from lm_eval.api.registry import get_model

    from pagellm.eval.lm_eval_model import PagellmLM

    assert get_model("pagellm") is PagellmLM
    missing = str(tmp_path / "no-such-model")  # never opened: every refusal comes first
    for kwargs, match in [({"batch_size": 0}, "batch_size"), ({"max_length": 1}, "max_length"),
                          ({"max_gen_toks": 0}, "max_gen_toks"), ({"device": "tpu"}, "device")]:
        with pytest.raises(ValueError, match=match):
            PagellmLM(pretrained=missing, **kwargs)
