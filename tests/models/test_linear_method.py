"""The LinearMethod seam: a toy int8 format registered from this file, loaded through LLM, against HF in
float32 with the same dequantized weights; the loader contract for formats laid out differently; bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from paged_model_utils import hf_greedy, random_prompts
from pagellm import SamplingParams
from pagellm.config import ModelConfig
from pagellm.layers import Linear, QKVLinear
from pagellm.layers.linear import linear
from pagellm.model_loader import build_model, open_model
from pagellm.models import WeightLoadError
from pagellm.quantization import (
    LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod, get_quantization_config_cls,
    list_quantization_methods, new_linear_param, register_quantization_config,
)

TOY = "toy_int8_rowwise"
PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the toy format: int8 weight [out, in] + one float scale per output row ---------------------------
def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(scale.dtype) * scale[:, None]


class ToyInt8LinearMethod(LinearMethodBase):
    def __init__(self) -> None:
        self.num_apply_calls = 0
        self.processed = False

    def create_weights(self, layer, input_size, output_partition_sizes, output_size, params_dtype, bias, **extra):
        layer.register_parameter("weight", new_linear_param((output_size, input_size), torch.int8, extra))
        layer.register_parameter("weight_scale", new_linear_param((output_size,), params_dtype, extra))
        if bias:
            layer.register_parameter("bias", new_linear_param((output_size,), params_dtype, extra))

    def process_weights_after_loading(self, layer) -> None:
        self.processed = True

    def apply(self, layer, x, bias=None):
        self.num_apply_calls += 1
        return F.linear(x, dequantize(layer.weight, layer.weight_scale).to(x.dtype), bias)


@register_quantization_config(TOY)
class ToyInt8Config(QuantizationConfig):
    @classmethod
    def get_name(cls) -> str:
        return TOY

    @classmethod
    def from_config(cls, config: dict) -> "ToyInt8Config":
        return cls()

    def get_linear_method(self, layer, prefix: str) -> LinearMethodBase:
        return ToyInt8LinearMethod()


def _write_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def toy_dir(tiny_llama_dir, tmp_path_factory):
    """tiny_llama_dir with every decoder projection in the toy format (HF names + `.weight_scale`); its config
    names no quant_method, so only an explicit quantization=TOY loads it."""
    path = tmp_path_factory.mktemp("toy-int8") / "llama"
    shutil.copytree(tiny_llama_dir, path)
    sd = load_file(path / "model.safetensors")
    for name in [n for n in sd if n.rpartition(".")[0].endswith(PROJS)]:
        sd[name], sd[name.replace(".weight", ".weight_scale")] = quantize(sd[name])
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def dequantized_hf(tiny_llama_dir):
    """The HF float32 model whose projections are dequantize(quantize(w)): what the toy format computes."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.rpartition(".")[0].endswith(PROJS):
                p.copy_(dequantize(*quantize(p)))
    return hf


def _linears(model) -> list:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _LLM(*args, **kwargs):
    pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")
    from pagellm import LLM  # noqa: PLC0415

    return LLM(*args, **kwargs)


# ---- end to end ---------------------------------------------------------------------------------------
def test_toy_format_through_llm_matches_dequantized_hf(toy_dir, dequantized_hf, tiny_tokenizer):
    prompts = random_prompts([3, 17, 33], len(tiny_tokenizer) - 5, seed=1)
    expected = [hf_greedy(dequantized_hf, p, 12) for p in prompts]
    llm = _LLM(str(toy_dir), quantization=TOY, max_model_len=128, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    linears = _linears(llm.llm_engine.model)
    assert len(linears) == 4 * 2  # qkv, o, gate_up, down per layer
    for lin in linears:
        assert isinstance(lin.linear_method, ToyInt8LinearMethod) and lin.linear_method.processed
        assert lin.weight.dtype == torch.int8 and lin.linear_method.num_apply_calls > 0


def test_checkpoint_quant_method_is_used_when_none_named(toy_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(toy_dir, path)
    _write_config(path, quantization_config={"quant_method": TOY})
    model = build_model(open_model(path))
    assert all(isinstance(m.linear_method, ToyInt8LinearMethod) for m in _linears(model))
    qkv = model.model.layers[1].self_attn.qkv_proj
    sd = load_file(toy_dir / "model.safetensors")
    k_off, k_size = qkv.shard_offsets["k"]
    scale = sd["model.layers.1.self_attn.k_proj.weight_scale"]
    assert torch.equal(qkv.weight_scale[k_off:k_off + k_size], scale)  # per-row scales follow the shard offsets
    assert "model.layers.1.mlp.up_proj.weight_scale" in model.expected_weight_names()


def test_toy_checkpoint_without_the_method_is_refused(toy_dir):
    with pytest.raises(WeightLoadError, match=r"weight_scale.*unexpected tensor"):
        build_model(open_model(toy_dir))  # unquantized layers have no weight_scale


def test_missing_scale_is_named(toy_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(toy_dir, path)
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.0.mlp.gate_proj.weight_scale"]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"gate_proj\.weight_scale.*missing"):
        build_model(open_model(path), quantization=TOY)


def test_unquantized_is_the_default(tiny_llama_dir):
    model = build_model(open_model(tiny_llama_dir))
    for lin in _linears(model):
        assert type(lin.linear_method) is UnquantizedLinearMethod
        assert lin.weight.dtype == torch.float32 and lin.weight.shape == (lin.out_features, lin.in_features)
        x = torch.randn(3, lin.in_features)
        # fp32 runs pagellm's linear_small_m (linear_dispatch), not torch's GEMM: the same product, summed in
        # another order, so equal to F.linear within fp32 rounding (a wrong weight or a lost bias is far off)
        assert torch.equal(lin(x), linear(x, lin.weight, lin.bias))
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


# ---- bad input ----------------------------------------------------------------------------------------
def test_unknown_method_name_lists_registered(tiny_llama_dir):
    assert TOY in list_quantization_methods()
    for call in (lambda: get_quantization_config_cls("nope4bit"), lambda: ModelConfig(quantization="nope4bit"),
                 lambda: build_model(open_model(tiny_llama_dir), quantization="nope4bit")):
        with pytest.raises(ValueError, match="nope4bit") as e:
            call()
        assert TOY in str(e.value)


def test_llm_refuses_an_unknown_method_name(tiny_llama_dir):
    with pytest.raises(ValueError, match=rf"quantization.*{TOY}.*nope4bit"):
        _LLM(str(tiny_llama_dir), quantization="nope4bit")


def test_checkpoint_with_unregistered_method(tiny_llama_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, path)
    _write_config(path, quantization_config={"quant_method": "gptq_not_here", "bits": 4})
    with pytest.raises(ValueError, match=rf"config\.json.*gptq_not_here.*{TOY}"):
        build_model(open_model(path))
    with pytest.raises(ValueError, match=rf"quantization='{TOY}'.*gptq_not_here"):
        build_model(open_model(path), quantization=TOY)


def test_registry_refuses_a_second_class_under_a_taken_name():
    assert register_quantization_config(TOY)(ToyInt8Config) is ToyInt8Config  # same class: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_quantization_config(TOY)(type("Other", (ToyInt8Config,), {}))
    with pytest.raises(TypeError, match="QuantizationConfig"):
        register_quantization_config("not_a_config")(object)


# ---- the loader contract for layouts other than [out, in] ---------------------------------------------
class PackedTransposedMethod(LinearMethodBase):
    """qweight [in, out/2] (two output rows per stored column: packed along the output dim) and one scale
    per checkpoint shard (no output dim: its own shard_loader)."""

    def create_weights(self, layer, input_size, output_partition_sizes, output_size, params_dtype, bias, **extra):
        layer.register_parameter("qweight", new_linear_param((input_size, output_size // 2), torch.int32, extra,
                                                             output_dim=1, output_pack_factor=2))

        def load_scale(param, loaded, shard):
            param.data[0 if shard is None else shard.index].copy_(loaded)

        layer.register_parameter("weight_scale", new_linear_param((len(output_partition_sizes),), params_dtype, extra,
                                                                  output_dim=None, shard_loader=load_scale))

    def apply(self, layer, x, bias=None):
        raise NotImplementedError


class _Fixed(QuantizationConfig):
    def __init__(self, method_cls):
        self.method_cls = method_cls

    @classmethod
    def get_name(cls):
        return "fixed"

    @classmethod
    def from_config(cls, config):
        raise NotImplementedError

    def get_linear_method(self, layer, prefix):
        return self.method_cls()


def test_shards_load_into_packed_and_per_shard_tensors():
    qkv = QKVLinear(8, 4, num_heads=2, num_kv_heads=1, quant_config=_Fixed(PackedTransposedMethod))  # q 8, k 4, v 4
    parts = {s: torch.randint(0, 100, (8, n // 2), dtype=torch.int32) for s, n in (("q", 8), ("k", 4), ("v", 4))}
    for i, (shard, t) in enumerate(parts.items()):
        qkv.qweight.weight_loader(qkv.qweight, t, shard)
        qkv.weight_scale.weight_loader(qkv.weight_scale, torch.tensor(float(i + 1)), shard)
    assert torch.equal(qkv.qweight, torch.cat(list(parts.values()), dim=1))
    assert qkv.weight_scale.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="shape mismatch for shard 'k'"):
        qkv.qweight.weight_loader(qkv.qweight, torch.zeros(8, 3, dtype=torch.int32), "k")


def test_create_weights_must_attach_the_loader():
    class NoLoader(ToyInt8LinearMethod):
        def create_weights(self, layer, input_size, output_partition_sizes, output_size, params_dtype, bias, **extra):
            layer.register_parameter("weight", torch.nn.Parameter(torch.empty(output_size, input_size)))

    with pytest.raises(TypeError, match="without a weight_loader"):
        Linear(4, 4, quant_config=_Fixed(NoLoader))
