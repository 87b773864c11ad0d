"""GGUF: a tiny llama GGUF written with gguf.GGUFWriter (F32/F16/Q8_0/Q4_0/Q4_1 tensors, permuted q/k like
llama.cpp), converted once to an HF dir; dequantization vs gguf.quants; model vs transformers loading the
same .gguf. Plus the default model (SmolLM2-135M-Instruct Q4_1) vs transformers on the same GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as tf

from paged_model_utils import (
    available_backends, hf_greedy, hf_greedy_batch, hf_prompt_logprobs, make_backend, make_tiny_hf, paged_greedy,
    paged_prompt_logprobs, random_prompts,
)
from pagellm.model_loader import (
    DEFAULT_MODEL_NAME, build_model, default_model_gguf_path, gguf_to_hf_dir, open_model,
)
from pagellm.model_loader import gguf_convert

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# per HF tensor kind -> quantization written into the tiny GGUF
QTYPES = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1, "o_proj": Q.F16, "gate_proj": Q.Q4_1,
          "up_proj": Q.Q8_0, "down_proj": Q.Q4_0, "embed_tokens": Q.Q8_0, "lm_head": Q.F16}
_TO_GGUF = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (HF rotate_half layout -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GLOBAL_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of an HF Llama tensor (blk.N.attn_q.weight, token_embd.weight, ...)."""
    if hf_name in _GLOBAL_TO_GGUF:
        return _GLOBAL_TO_GGUF[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_llama_gguf(path, hf, tokenizer, qtype_of, quantize=None) -> None:
    """hf's weights and tokenizer as a llama GGUF, q/k rows permuted as llama.cpp's converter does; each tensor in
    the type `qtype_of(hf_name, gguf_name, array)` gives (F32, F16 or a block type), its blocks made by
    `quantize(array, qtype)` (default gguf.quants.quantize, which lacks the k-quants)."""
    quantize = quantize or gguf.quants.quantize
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    # tokenizer (gpt2-style byte-level BPE) + chat template
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t.content for t in tokenizer.added_tokens_decoder.values()}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    merges = tj["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tokenizer.chat_template)
    for name, t in hf.state_dict().items():
        a = t.float().numpy()
        g = gguf_tensor_name(name)
        if "self_attn.q_proj" in name:
            a = llamacpp_permute(a, cfg.num_attention_heads)
        elif "self_attn.k_proj" in name:
            a = llamacpp_permute(a, cfg.num_key_value_heads)
        qtype = qtype_of(name, g, a)
        if qtype == Q.F32:
            w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
        elif qtype == Q.F16:
            w.add_tensor(g, a.astype(np.float16))
        else:
            w.add_tensor(g, quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(path, hf, tokenizer) -> None:
    """The tiny test GGUF: each kind of tensor in the type QTYPES gives it (vectors F32)."""
    write_llama_gguf(path, hf, tokenizer,
                     lambda name, g, a: QTYPES.get(name.split(".")[-2], Q.F32) if a.ndim == 2 else Q.F32)


def hf_from_gguf(path):
    """transformers' own GGUF loading (config, dequantization, q/k un-permutation) of `path`, float32.
    `from_pretrained(gguf_file=...)` needs `accelerate`; without it, use the same integration directly."""
    try:
        import accelerate  # noqa: F401

        return tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                       dtype=torch.float32).eval()
    except ImportError:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        config = tf.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        model = tf.LlamaForCausalLM(config).float().eval()
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        if config.tie_word_embeddings:
            model.tie_weights()
        else:
            assert "lm_head.weight" in tensors
        return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tokenizer):
    d = tmp_path_factory.mktemp("gguf")
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=11, vocab_size=len(tiny_tokenizer),
                      hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    path = d / "tiny-llama.gguf"
    write_tiny_gguf(path, hf, tiny_tokenizer)
    return path, hf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_dequantize_matches_gguf_quants(tiny_gguf):
    path, hf = tiny_gguf
    reader = gguf.GGUFReader(str(path))
    seen = set()
    sd = hf.state_dict()
    for t in reader.tensors:
        ours = gguf_convert.dequantize_tensor(t)
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.shape)
        np.testing.assert_array_equal(ours, ref)
        seen.add(t.tensor_type)
        hf_name = gguf_convert.gguf_name_to_hf(t.name)
        orig = sd[hf_name].numpy()
        if ".attn_q." in t.name:
            ours = gguf_convert.unpermute_qk(ours, hf.config.num_attention_heads)
        elif ".attn_k." in t.name:
            ours = gguf_convert.unpermute_qk(ours, hf.config.num_key_value_heads)
        tol = {Q.F32: 0, Q.F16: 1e-3, Q.Q8_0: 0.01, Q.Q4_0: 0.1, Q.Q4_1: 0.1}[t.tensor_type]
        assert ours.shape == orig.shape and np.abs(ours - orig).max() <= tol, t.name
    assert {Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= seen


def test_gguf_matches_transformers(tiny_gguf, cache, tiny_tokenizer):
    path, _ = tiny_gguf
    files = open_model(path)
    assert files.path.parent.parent == cache and files.source == path
    assert (files.path / "model.safetensors").is_file()
    assert files.hf_config.architectures == ["LlamaForCausalLM"]
    assert files.generation_config["eos_token_id"] == [tiny_tokenizer.eos_token_id]
    tok = files.tokenizer
    assert tok.chat_template == tiny_tokenizer.chat_template
    text = "Tell me about the sea, naïve café 🙂"
    assert tok(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]

    model = build_model(files, dtype="float32")
    ref = hf_from_gguf(path)
    be = make_backend(available_backends()[0])
    prompts = random_prompts([5, 33, 70], files.hf_config.vocab_size, seed=2)
    for p, lp in zip(prompts, paged_prompt_logprobs(model, be, prompts, 16)):
        assert (lp - hf_prompt_logprobs(ref, p)).abs().max().item() < 1e-4
    assert paged_greedy(model, be, prompts, 32, 16) == hf_greedy_batch(ref, prompts, 32)


def test_gguf_converted_once(tiny_gguf, cache, monkeypatch):
    path, _ = tiny_gguf
    first = gguf_to_hf_dir(path)
    assert not [p for p in first.parent.iterdir() if ".tmp-" in p.name]  # temp dir renamed away
    monkeypatch.setattr(gguf_convert, "_convert", lambda *a: pytest.fail("converted twice"))
    assert gguf_to_hf_dir(path) == first
    assert open_model(path).path == first


def test_gguf_bad_architecture(tmp_path, cache):
    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match=r"x\.gguf.*'gpt2' is not supported"):
        open_model(path)
    assert not list(cache.rglob("config.json"))


# ------------------------------------------------------------------------------------------- default model
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a paged KV cache is in one sentence.",
    "List three colors.",
    "def fibonacci(n):",
]


def test_default_model_path():
    p = default_model_gguf_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.is_file()
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_default_model_matches_transformers():
    """Greedy 48 tokens x 5 chat prompts identical to transformers on the same GGUF (float32). Uses the real
    user cache dir (or $PAGELLM_CACHE_DIR), so the one-time conversion is reused across runs."""
    files = open_model(None)
    assert files.tokenizer.chat_template and files.generation_config["eos_token_id"] == [2]
    model = build_model(files, dtype="float32")
    gpath = default_model_gguf_path()
    ref = hf_from_gguf(gpath)
    tok = files.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True)
               for m in PROMPTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    backend = "cpu" if "cpu" in available_backends() else available_backends()[0]
    ours = paged_greedy(model, make_backend(backend), prompts, 48, 16)
    for p, g in zip(prompts, ours):
        assert g == hf_greedy(ref, p, 48), tok.decode(p)
