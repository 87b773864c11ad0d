"""A researcher's Python attention backend, registered at run time, runs the model and is used."""

import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.attention import list_attention_backends, register_attention_backend
from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.torch_backend import TorchAttentionBackend

pytest.importorskip("pagellm._C", reason="the engine needs the compiled scheduler (run `make install`)")


@register_attention_backend("test-counting")
class CountingBackend(TorchAttentionBackend):
    """The reference backend plus a call counter and an optional output scale."""

    calls = 0
    scale = 1.0

    def forward(self, layer, query, key, value, kv_cache):
        type(self).calls += 1
        return super().forward(layer, query, key, value, kv_cache) * type(self).scale


def _run(model_dir, backend: str, prompts):
    llm = LLM(str(model_dir), dtype="float32", attention_backend=backend, num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_custom_backend_is_called_and_its_result_is_used(tiny_llama_dir, tiny_tokenizer):
    assert "test-counting" in list_attention_backends()
    rng = random.Random(3)
    prompts = [[rng.randrange(5, len(tiny_tokenizer)) for _ in range(n)] for n in (5, 23)]
    fast = _run(tiny_llama_dir, "cpu", prompts)

    CountingBackend.calls, CountingBackend.scale = 0, 1.0
    same = _run(tiny_llama_dir, "test-counting", prompts)
    assert CountingBackend.calls > 0
    assert [o.outputs[0].token_ids for o in same] == [o.outputs[0].token_ids for o in fast]

    # Its output is what the model consumes: scaling every attention output changes the logprobs.
    CountingBackend.calls, CountingBackend.scale = 0, 3.0
    scaled = _run(tiny_llama_dir, "test-counting", prompts)
    assert CountingBackend.calls > 0
    first = lambda outs: next(iter(outs[0].outputs[0].logprobs[0].values())).logprob  # noqa: E731
    assert abs(first(scaled) - first(same)) > 1e-3


@register_attention_backend("test-cpu-subclass")
class CountingCpuBackend(CpuAttentionBackend):
    """A subclass of the C++ backend that overrides forward: a captured step graph must not bypass it."""

    decode_calls = 0

    def forward(self, layer, query, key, value, kv_cache):
        if self.metadata.num_decode_reqs == self.metadata.num_reqs:
            type(self).decode_calls += 1
        return super().forward(layer, query, key, value, kv_cache)


def test_step_graph_never_bypasses_a_backend_subclass(tiny_llama_dir, tiny_tokenizer):
    llm = LLM(str(tiny_llama_dir), dtype="float32", attention_backend="test-cpu-subclass", num_kv_blocks=64,
              max_model_len=256)
    assert llm.llm_engine.runner.step_graphs is None  # its Python forward may do anything: never replayed
    CountingCpuBackend.decode_calls = 0
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert CountingCpuBackend.decode_calls > 0
    # the plain cpu backend does replay step graphs
    assert LLM(str(tiny_llama_dir), dtype="float32", attention_backend="cpu", num_kv_blocks=64,
               max_model_len=256).llm_engine.runner.step_graphs is not None
