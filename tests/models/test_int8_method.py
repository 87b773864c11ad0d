"""quantization="int8" (LLM.int8()) end to end on a tiny random Llama, through LLM.

- against the op's pure-torch reference on the same quantized weights (every linear's `op` swapped for
  `pagellm.ops.reference.int8_linear`, same batches): greedy tokens equal; logprobs within 1e-2, median 1e-5
  (the int32 sums are exact; the fp32 sums of outlier terms round differently, and such a difference can
  move one activation across an int8 rounding boundary in a later layer: one step of absmax / 127);
- against the unquantized float32 model: prompt logprobs (teacher-forced) within 0.15 of each other
  everywhere and 0.03 on average (measured on this model: 0.04 and 0.009);
- decode steps replayed from step graphs give bit-identical tokens and logprobs to enforce_eager=True.
Variants: the default (threshold 6), a low threshold with absmax activations, a low threshold with zero-point
activations, and per-token groups of 64 at a low threshold.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_model_utils import random_prompts
from pagellm import SamplingParams
from pagellm.layers import Linear
from pagellm.model_loader import build_model, open_model
from pagellm.models import WeightLoadError
from pagellm.ops import ops_available, reference
from pagellm.quantization import Int8Config, Int8LinearMethod
from pagellm.quantization.int8 import DEFAULT_ACTIVATION_SCHEME, quantize_weight_rows

pytestmark = pytest.mark.skipif(not ops_available()[0], reason="needs the C++ extension (make install)")
LOW_THRESHOLD = 2.5  # RMSNorm outputs of the tiny model are ~N(0, 1): several outlier columns per batch
NEW_TOKENS = 12


def _write_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _int8_dir(tiny_llama_dir, tmp_path_factory, name: str, **config) -> Path:
    """A copy of the tiny float32 Llama whose config asks for int8 with a low threshold and these options."""
    path = tmp_path_factory.mktemp(name) / "llama"
    shutil.copytree(tiny_llama_dir, path)
    _write_config(path, quantization_config={"quant_method": "int8", "threshold": LOW_THRESHOLD, **config})
    return path


@pytest.fixture(scope="module")
def low_threshold_dir(tiny_llama_dir, tmp_path_factory):
    """int8 with a low outlier threshold and absmax activations."""
    return _int8_dir(tiny_llama_dir, tmp_path_factory, "int8-low", activation_scheme="absmax")


@pytest.fixture(scope="module")
def zero_point_dir(tiny_llama_dir, tmp_path_factory):
    """int8 with zero-point activations and a low threshold."""
    return _int8_dir(tiny_llama_dir, tmp_path_factory, "int8-zp", activation_scheme="zeropoint")


@pytest.fixture(scope="module")
def group_dir(tiny_llama_dir, tmp_path_factory):
    """int8 with per-token groups of 64 and a low threshold."""
    return _int8_dir(tiny_llama_dir, tmp_path_factory, "int8-group", activation_scheme="group", group_size=64)


VARIANTS = ["default_threshold", "low_threshold", "zero_point", "group"]


def _variant(which, tiny_llama_dir, low_threshold_dir, zero_point_dir, group_dir=None):
    """(model dir, LLM kwargs) of one int8 configuration under test."""
    if which == "default_threshold":
        return tiny_llama_dir, {"quantization": "int8"}
    if which == "group":
        return group_dir, {}
    return (low_threshold_dir if which == "low_threshold" else zero_point_dir), {}


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return random_prompts([3, 17, 33, 50], len(tiny_tokenizer) - 5, seed=1)


def _linears(llm) -> list[Linear]:
    return [m for m in llm.llm_engine.model.modules() if isinstance(m, Linear)]


def _generate(path, prompts, *, use_reference=False, **kwargs):
    """(greedy tokens, their logprobs, teacher-forced prompt logprobs, the LLM) for the prompts in one batch."""
    from pagellm import LLM  # noqa: PLC0415

    llm = LLM(str(path), max_model_len=128, seed=0, num_kv_blocks=64, **kwargs)
    if use_reference:
        for lin in _linears(llm):
            lin.linear_method.op = reference.int8_linear
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=0,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    prompt_lps = [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]
    return tokens, logprobs, prompt_lps, llm


def _flat(nested) -> torch.Tensor:
    return torch.tensor([v for row in nested for v in row], dtype=torch.float64)


# ---- loading --------------------------------------------------------------------------------------------
def test_weights_are_int8_quantized_per_row(tiny_llama_dir):
    model = build_model(open_model(tiny_llama_dir), quantization="int8")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 and all(isinstance(m.linear_method, Int8LinearMethod) for m in linears)
    sd = load_file(tiny_llama_dir / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj
    off, size = qkv.shard_offsets["k"]
    q, scale = quantize_weight_rows(sd["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(qkv.weight[off:off + size], q) and torch.equal(qkv.weight_scale[off:off + size], scale)
    for lin in linears:
        assert lin.weight.dtype == torch.int8 and lin.weight_scale.dtype == torch.float32
        assert lin.linear_method.op is torch.ops.pagellm.int8_linear.default
    assert model.lm_head.weight.dtype == torch.float32  # the head stays in the model dtype


def test_checkpoint_quantization_config_sets_the_threshold(low_threshold_dir, tiny_llama_dir):
    model = build_model(open_model(low_threshold_dir))
    methods = [m.linear_method for m in model.modules() if isinstance(m, Linear)]
    assert methods and all(m.threshold == LOW_THRESHOLD for m in methods)
    assert all(m.activation_scheme == "absmax" and not m.zero_point for m in methods)
    default = build_model(open_model(tiny_llama_dir), quantization="int8")
    methods = [m.linear_method for m in default.modules() if isinstance(m, Linear)]
    assert methods and all(m.activation_scheme == DEFAULT_ACTIVATION_SCHEME == "group" and m.group_size == 64
                           for m in methods)


def test_checkpoint_quantization_config_sets_the_activation_scheme(zero_point_dir, group_dir):
    model = build_model(open_model(zero_point_dir))
    methods = [m.linear_method for m in model.modules() if isinstance(m, Linear)]
    assert methods and all(m.activation_scheme == "zeropoint" and m.zero_point for m in methods)
    model = build_model(open_model(group_dir))
    methods = [m.linear_method for m in model.modules() if isinstance(m, Linear)]
    assert methods and all(m.activation_scheme == "group" and m.group_size == 64 and not m.zero_point
                           for m in methods)


def test_skip_modules_keep_those_linears_in_the_model_dtype(tiny_llama_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, path)
    _write_config(path, quantization_config={"quant_method": "int8", "skip_modules": ["down_proj", "model.layers.0"]})
    model = build_model(open_model(path))
    sd = load_file(tiny_llama_dir / "model.safetensors")
    for name, lin in ((n, m) for n, m in model.named_modules() if isinstance(m, Linear)):
        skipped = name.endswith("down_proj") or name.startswith("model.layers.0.")
        assert isinstance(lin.linear_method, Int8LinearMethod) != skipped, name
        if skipped and name.endswith("down_proj"):  # loaded as in the checkpoint
            assert lin.weight.dtype == torch.float32 and torch.equal(lin.weight, sd[f"{name}.weight"])
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.int8


def test_bad_input_is_refused(tiny_llama_dir, tmp_path):
    for bad in ("down_proj", [""], [".down_proj"], [3]):
        with pytest.raises(ValueError, match="skip_modules must be a list of module names"):
            Int8Config.from_config({"quant_method": "int8", "skip_modules": bad})
    with pytest.raises(ValueError, match="threshold"):
        Int8Config.from_config({"quant_method": "int8", "threshold": -1})
    for bad in ("zero_point", "ABSMAX", None, 1):
        with pytest.raises(ValueError, match=r"activation_scheme must be one of \['absmax', 'zeropoint', 'group'\]"):
            Int8Config.from_config({"quant_method": "int8", "activation_scheme": bad})
    for bad in (0, 32, 100, -64, 64.0, True, "64"):
        with pytest.raises(ValueError, match="group_size must be a positive multiple of 64"):
            Int8Config.from_config({"quant_method": "int8", "activation_scheme": "group", "group_size": bad})
    with pytest.raises(ValueError, match=r"unknown keys \['bits'\].*allowed"):
        Int8Config.from_config({"quant_method": "int8", "bits": 4})
    path = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, path)
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"].to(torch.int8)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"down_proj\.weight.*quantizes float checkpoints.*torch\.int8"):
        build_model(open_model(path), quantization="int8")


# ---- end to end -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", VARIANTS)
def test_matches_the_reference_op_on_the_same_weights(which, tiny_llama_dir, low_threshold_dir, zero_point_dir,
                                                      group_dir, prompts):
    path, kw = _variant(which, tiny_llama_dir, low_threshold_dir, zero_point_dir, group_dir)
    tokens, lps, prompt_lps, llm = _generate(path, prompts, **kw)
    ref_tokens, ref_lps, ref_prompt_lps, _ = _generate(path, prompts, use_reference=True, enforce_eager=True, **kw)
    assert tokens == ref_tokens
    for ours, ref in ((lps, ref_lps), (prompt_lps, ref_prompt_lps)):
        diff = (_flat(ours) - _flat(ref)).abs()
        assert diff.max() <= 1e-2 and diff.median() <= 1e-5, (float(diff.max()), float(diff.median()))
    if which != "default_threshold":  # the outlier path really ran: some linear input has a column above it
        peak = max(float(x.abs().max()) for x in _linear_inputs(llm, prompts[-1]))
        assert peak > LOW_THRESHOLD


def _linear_inputs(llm, prompt) -> list[torch.Tensor]:
    """The inputs every linear layer sees in an eager prefill of `prompt`."""
    seen: list[torch.Tensor] = []
    hooks = [lin.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
             for lin in _linears(llm)]
    try:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("which", VARIANTS)
def test_close_to_the_unquantized_model(which, tiny_llama_dir, low_threshold_dir, zero_point_dir, group_dir, prompts):
    path, kw = _variant(which, tiny_llama_dir, low_threshold_dir, zero_point_dir, group_dir)
    tokens, _, prompt_lps, _ = _generate(path, prompts, **kw)
    _, _, fp32_prompt_lps, _ = _generate(tiny_llama_dir, prompts)
    diff = (_flat(prompt_lps) - _flat(fp32_prompt_lps)).abs()
    assert diff.max() < 0.15 and diff.mean() < 0.03, (float(diff.max()), float(diff.mean()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("which", VARIANTS)
def test_step_graph_replay_is_bit_identical_to_eager(which, dtype, tiny_llama_dir, low_threshold_dir, zero_point_dir,
                                                     group_dir, prompts):
    path, kw = _variant(which, tiny_llama_dir, low_threshold_dir, zero_point_dir, group_dir)
    eager = _generate(path, prompts, dtype=dtype, enforce_eager=True, **kw)
    replay = _generate(path, prompts, dtype=dtype, **kw)
    graphs = replay[3].llm_engine.runner.step_graphs
    assert graphs is not None and graphs.num_captures > 0 and graphs.num_replays > 0
    assert replay[0] == eager[0]
    assert replay[1] == eager[1] and replay[2] == eager[2]  # exact floats
