"""The token embedding and LM head behind the quantization seam: with quantization="gguf" a .gguf file's
token_embd (and an untied output) stay in their Q8_0 / Q4_0 / Q4_1 blocks, held once when tied; the head is
`gguf_linear`, the embedding dequantizes only the looked-up rows. Other formats keep them float.

References: gguf-py's numpy dequantization of the file's tensors, directly (embedding rows, logits) and
through the dequantized load path (the same model with float32 weights). Tolerance: float32 logits within
1e-4 (the native kernels dequantize exactly as gguf-py and differ only in summation order); embedding rows
and greedy tokens identical.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import transformers as tf

from paged_model_utils import available_backends, make_backend, make_tiny_hf, paged_greedy, paged_prompt_logprobs, random_prompts
from pagellm import LLM, SamplingParams
from pagellm.layers import LMHead, VocabEmbedding
from pagellm.model_loader import build_model, open_model
from pagellm.quantization import (
    GGUFConfig, GGUFEmbeddingMethod, GGUFLinearMethod, Int8Config, UnquantizedEmbeddingMethod,
)
from test_gguf import write_llama_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

LINEAR_TYPES = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
                "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0}
# (token_embd type, output type or None = tied: the file has no output.weight)
CASES = {"tied-q8_0": (Q.Q8_0, None), "tied-q4_0": (Q.Q4_0, None), "untied-q8_0-q4_0": (Q.Q8_0, Q.Q4_0),
         "untied-q4_0-q8_0": (Q.Q4_0, Q.Q8_0)}


def write_gguf(path, tokenizer, embd_type, output_type) -> None:
    """A tiny random Llama as a GGUF: linears per LINEAR_TYPES, token_embd / output as given (no output when tied)."""
    tied = output_type is None
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=7, vocab_size=len(tokenizer), hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=tied)
    state = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    source = types.SimpleNamespace(config=hf.config, state_dict=lambda: state)

    def qtype_of(name: str, gguf_name: str, array) -> object:
        if gguf_name == "token_embd.weight":
            return embd_type
        if gguf_name == "output.weight":
            return output_type
        return LINEAR_TYPES.get(gguf_name.split(".")[2], Q.F32) if array.ndim == 2 else Q.F32

    write_llama_gguf(path, source, tokenizer, qtype_of)


def gguf_py_weight(path, gguf_name: str) -> torch.Tensor:
    """gguf-py's dequantization of one tensor of the file, float32 [rows, cols] (the reference)."""
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == gguf_name)
    rows = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
    return torch.from_numpy(rows.reshape(int(t.shape[1]), int(t.shape[0])).copy())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(params=list(CASES))
def case(request, tmp_path, cache, tiny_tokenizer):
    embd_type, output_type = CASES[request.param]
    path = tmp_path / f"{request.param}.gguf"
    write_gguf(path, tiny_tokenizer, embd_type, output_type)
    return path, embd_type, output_type


def vocab_sized_floats(model: torch.nn.Module, vocab: int, hidden: int) -> list[str]:
    """Names of float parameters / buffers shaped like a whole embedding (either orientation)."""
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    return [n for n, t in tensors if t.is_floating_point() and sorted(t.shape) == sorted((vocab, hidden))]


def test_head_and_embedding_hold_the_files_blocks_once(case):
    path, embd_type, output_type = case
    model = build_model(open_model(path), "float32", quantization="gguf")
    cfg = model.config
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed.linear_method, GGUFEmbeddingMethod) and embed.linear_method.type_name == embd_type.name
    assert embed.qweight.dtype == torch.uint8 and head.tied == (output_type is None)
    if output_type is None:
        assert head.qweight is embed.qweight and head.linear_method is embed.linear_method
        assert [n for n, p in model.named_parameters() if p.dtype == torch.uint8 and p.shape[0] == cfg.vocab_size] == [
            "model.embed_tokens.qweight"]
    else:
        assert isinstance(head.linear_method, GGUFEmbeddingMethod) and head.linear_method.type_name == output_type.name
        assert head.qweight.data_ptr() != embed.qweight.data_ptr()
    assert vocab_sized_floats(model, cfg.vocab_size, cfg.hidden_size) == []
    # every layer's blocks, so a decode step reads only blocks
    assert all(isinstance(m.linear_method, (GGUFLinearMethod, GGUFEmbeddingMethod))
               for m in model.modules() if hasattr(m, "linear_method"))


def test_lookup_and_logits_match_gguf_py(case, monkeypatch):
    """Embedding rows equal gguf-py's dequantized rows (float32 exactly, bfloat16 = those rounded); float32
    logits of the head within 1e-4 of hidden @ gguf-py's dequantized weight^T, compiled and reference op."""
    path, _, output_type = case
    files = open_model(path)
    embd_ref = gguf_py_weight(path, "token_embd.weight")
    head_ref = embd_ref if output_type is None else gguf_py_weight(path, "output.weight")
    ids = torch.tensor([[0, 5, 5], [files.hf_config.vocab_size - 1, 17, 2]])
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(files, dtype, quantization="gguf")
        rows = model.model.embed_tokens(ids)
        assert rows.dtype == dtype and rows.shape == (2, 3, 64)
        assert torch.equal(rows, embd_ref[ids].to(dtype))
    model = build_model(files, "float32", quantization="gguf")
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    expected = (hidden.double() @ head_ref.double().T).float()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, files.hf_config.vocab_size)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
    from pagellm.quantization import gguf_op

    monkeypatch.setattr(gguf_op, "gguf_linear_op", gguf_op.reference_gguf_linear)  # pagellm._C missing
    torch.testing.assert_close(model.compute_logits(hidden), expected, atol=1e-4, rtol=1e-5)


def test_native_head_matches_dequantized_path(case):
    """Prompt logprobs (prefill, M < 16 and M >= 16 head paths) within 1e-4 and greedy tokens identical to the
    same file loaded dequantized (gguf-py) in float32."""
    path = case[0]
    files = open_model(path)
    native, deq = build_model(files, "float32", quantization="gguf"), build_model(files, "float32")
    be = make_backend("cpu" if "cpu" in available_backends() else available_backends()[0])
    prompts = random_prompts([3, 21, 40], files.hf_config.vocab_size, seed=8)
    for a, b in zip(paged_prompt_logprobs(native, be, prompts, 16), paged_prompt_logprobs(deq, be, prompts, 16)):
        assert (a - b).abs().max().item() < 1e-4
    assert paged_greedy(native, be, prompts, 20, 16) == paged_greedy(deq, be, prompts, 20, 16)


def _generate(path, dtype, **kwargs):
    llm = LLM(str(path), dtype=dtype, num_kv_blocks=64, block_size=16, max_model_len=256, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts([4, 25], 300, seed=2)], params,
                        use_tqdm=False)
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return [o.outputs[0].token_ids for o in outs], logprobs, llm.llm_engine.runner.step_graphs


@pytest.mark.parametrize("name", ["tied-q8_0", "untied-q4_0-q8_0"])
def test_llm_decode_steps_replay_with_the_native_embedding(name, tmp_path, cache, tiny_tokenizer):
    """Through LLM, decode steps (whose forward starts with the row lookup) are captured and replayed: float32
    greedy tokens equal the dequantized path's; bfloat16 replay makes exactly the eager calls."""
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, tiny_tokenizer, *CASES[name])
    tokens, _, graphs = _generate(path, "float32", quantization="gguf")
    assert graphs.num_replays > 0
    assert tokens == _generate(path, "float32")[0]
    eager = _generate(path, "bfloat16", quantization="gguf", enforce_eager=True)
    replayed = _generate(path, "bfloat16", quantization="gguf")
    assert replayed[2].num_replays > 0 and replayed[:2] == eager[:2]


def test_unsupported_head_type_is_dequantized(tmp_path, cache, tiny_tokenizer):
    """An output.weight without a native kernel (Q5_0) loads as a float head; the Q8_0 embedding stays blocks."""
    path = tmp_path / "q5-head.gguf"
    write_gguf(path, tiny_tokenizer, Q.Q8_0, Q.Q5_0)
    model = build_model(open_model(path), "float32", quantization="gguf")
    assert isinstance(model.model.embed_tokens.linear_method, GGUFEmbeddingMethod)
    assert isinstance(model.lm_head.linear_method, UnquantizedEmbeddingMethod)
    assert torch.equal(model.lm_head.weight, gguf_py_weight(path, "output.weight"))


def test_other_formats_keep_the_head_float(tiny_llama_dir):
    """The default EmbeddingMethod (unquantized, the model dtype) for formats that do not override it (LLM.int8,
    and GGUF layers the file stores as float); a tied float head shares the embedding's weight."""
    assert Int8Config(6.0).get_embedding_method(None, "lm_head") is None  # the seam's default: unquantized
    assert isinstance(GGUFConfig({"lm_head": "Q8_0"}).get_embedding_method(None, "model.embed_tokens"),
                      UnquantizedEmbeddingMethod)
    model = build_model(open_model(tiny_llama_dir), "float32", quantization="int8")
    for layer in (model.model.embed_tokens, model.lm_head):
        assert isinstance(layer.linear_method, UnquantizedEmbeddingMethod) and layer.weight.dtype == torch.float32
    embed = VocabEmbedding(50, 32, dtype=torch.bfloat16)
    head = LMHead(50, 32, dtype=torch.bfloat16, tied_to=embed)
    assert head.weight is embed.weight
    with torch.no_grad():
        embed.weight.copy_(torch.randn(50, 32))
    ids = torch.tensor([3, 49, 3])
    assert torch.equal(embed(ids), embed.weight[ids])
    h = torch.randn(2, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(head(h).float(), h.float() @ embed.weight.float().T, atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match=r"tied LM head \[40, 32\] differs from its embedding \[50, 32\]"):
        LMHead(40, 32, tied_to=embed)
