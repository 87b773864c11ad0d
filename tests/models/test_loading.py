"""Loading HF directories: sharded safetensors, dtype choice, registry, and errors that name file and tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from paged_model_utils import make_backend, available_backends, hf_prompt_logprobs, make_tiny_hf, paged_prompt_logprobs
from pagellm.model_loader import ModelFiles, build_model, iter_weights, open_model, resolve_dtype
from pagellm.models import WeightLoadError, get_model_cls, list_models, register_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=3, head_dim=16)
    path = tmp_path_factory.mktemp("tiny") / "llama"
    hf.save_pretrained(path)
    return hf, path


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_sharded_safetensors(tmp_path):
    hf = make_tiny_hf(tf.Qwen2Config, tf.Qwen2ForCausalLM, seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    files = open_model(tmp_path)
    names = [n for n, _ in iter_weights(files)]
    assert len(names) == len(set(names)) == len(hf.state_dict())
    model = build_model(files, dtype="float32")
    prompt = list(range(3, 40))
    lp = paged_prompt_logprobs(model, make_backend(available_backends()[0]), [prompt], 16)[0]
    assert (lp - hf_prompt_logprobs(hf, prompt)).abs().max() < 1e-4


def test_open_model_tokenizer_and_generation_config(tiny_llama_dir):
    files = open_model(tiny_llama_dir)
    assert isinstance(files, ModelFiles) and files.path == tiny_llama_dir
    assert files.tokenizer is not None and files.tokenizer.chat_template
    assert files.generation_config["eos_token_id"] == [files.tokenizer.eos_token_id]
    model = build_model(files)
    assert next(model.parameters()).dtype == torch.float32  # config says float32


def test_generation_config_eos_normalized(tiny, tmp_path):
    _, src = tiny
    path = _copy(src, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "temperature": 0.6, "top_p": 0.9}))
    gen = open_model(path).generation_config
    assert gen["eos_token_id"] == [7] and gen["temperature"] == 0.6 and gen["top_p"] == 0.9


def test_dtype_resolution(tiny):
    _, path = tiny
    files = open_model(path)
    assert resolve_dtype("auto", files.hf_config) == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("float64")
    model = build_model(files, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.bfloat16


def test_missing_tensor_names_it(tiny, tmp_path):
    _, src = tiny
    path = _copy(src, tmp_path)
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*missing") as e:
        build_model(open_model(path))
    assert str(path) in str(e.value)


def test_shape_mismatch_names_file_and_tensor(tiny, tmp_path):
    _, src = tiny
    path = _copy(src, tmp_path)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :-1].contiguous()
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"up_proj\.weight.*model\.safetensors.*shape mismatch"):
        build_model(open_model(path))


def test_unexpected_tensor_names_it(tiny, tmp_path):
    _, src = tiny
    path = _copy(src, tmp_path)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.self_attn.bogus.weight"] = torch.zeros(3)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"bogus\.weight.*model\.safetensors.*unexpected tensor"):
        build_model(open_model(path))


def test_unknown_architecture(tiny, tmp_path):
    _, src = tiny
    path = _copy(src, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["NopeForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*NopeForCausalLM.*LlamaForCausalLM"):
        build_model(open_model(path))
    with pytest.raises(ValueError, match="supported"):
        get_model_cls("NopeForCausalLM")


def test_missing_files(tiny, tmp_path):
    _, src = tiny
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_model(tmp_path / "nope")
    path = _copy(src, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights files"):
        open_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        open_model(path)


def test_missing_shard_file(tmp_path):
    hf = make_tiny_hf(tf.LlamaConfig, tf.LlamaForCausalLM, seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        build_model(open_model(tmp_path))


def test_registry_one_decorator():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(list_models())
    Llama = get_model_cls("LlamaForCausalLM")

    @register_model("MyLlamaForCausalLM")
    class MyLlama(Llama):
        pass

    assert get_model_cls("MyLlamaForCausalLM") is MyLlama
