"""The executor/worker boundary: the engine runs the model only through its executor, and
collective_rpc reaches every worker."""

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine.executor import ExecutorBase, get_executor_cls, list_executors, register_executor

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")


def _llm(model_dir, **kw):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, **kw)


def test_collective_rpc_by_name_and_by_callable(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    (info,) = llm.collective_rpc("describe")
    assert info["rank"] == 0 and info["num_kv_blocks"] == 64 and info["dtype"] == "float32"
    # a callable gets the worker: here it reads a weight, then scales it in place (what a weight update does)
    (norm,) = llm.collective_rpc(lambda w, name: float(dict(w.model.named_parameters())[name].norm()),
                                 args=("model.norm.weight",))
    assert norm == pytest.approx(float(llm.llm_engine.model.model.norm.weight.norm()))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    before = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0].token_ids

    def perturb(worker, scale):
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in worker.model.named_parameters():
                if "down_proj" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)

    llm.collective_rpc(perturb, kwargs={"scale": 3.0})
    llm.reset_prefix_cache()  # the prompt's cached KV was computed with the old weights
    after = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert after != before  # the engine's next step ran on the updated weights (the step graphs saw them too)


def test_collective_rpc_rejects_unknown_and_private_methods(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    for bad in ("no_such_method", "__init__", "_private"):
        with pytest.raises(AttributeError):
            llm.collective_rpc(bad)
    with pytest.raises(TypeError):
        llm.collective_rpc(42)


def test_engine_steps_go_through_the_executor(tiny_llama_dir):
    calls = []

    @register_executor("test-counting")
    class CountingExecutor(get_executor_cls("uni")):
        def execute_model(self, sched_out, prompt_logprob_rows=None, **kwargs):
            calls.append(sched_out.num_reqs)
            return super().execute_model(sched_out, prompt_logprob_rows, **kwargs)

    assert "test-counting" in list_executors() and issubclass(CountingExecutor, ExecutorBase)
    llm = _llm(tiny_llama_dir, distributed_executor_backend="test-counting")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and len(calls) >= 5


def test_unknown_executor_is_a_value_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        _llm(tiny_llama_dir, distributed_executor_backend="nope")
    with pytest.raises(ValueError):
        EngineArgs(distributed_executor_backend="").create_engine_config(256)
