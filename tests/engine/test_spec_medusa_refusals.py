"""Medusa trees on models tree verification cannot run (attention/tree_verify.py) are refused when the LLM is built,
naming the reason (a quantized KV cache, sliding-window layers, an MLA latent cache), while chain drafts still work
there; cross-layer KV sharing is supported and decodes exactly like plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("pagellm._C", reason="needs the C++ extension (make install)")

from tiny_models import write_tiny_llama  # noqa: E402
from test_draft_tokens import _generate, _greedy, _make_llm, _tie_free_prompts  # noqa: E402

from pagellm.attention.tree_verify import tree_layer_refusal  # noqa: E402
from pagellm.kv_cache import LatentKVCache, PagedKVCache  # noqa: E402
from pagellm.kv_cache.spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec  # noqa: E402
from pagellm.spec_decode.medusa_heads import MedusaHeads  # noqa: E402

HIDDEN = 64  # write_tiny_llama's default


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, tiny_tokenizer):
    heads = MedusaHeads(HIDDEN, len(tiny_tokenizer), num_heads=3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return heads.save(tmp_path_factory.mktemp("medusa-heads"))


def _edited_llama(path, tokenizer, config_extra: dict, dropped_layers=()):
    """The tiny Llama with extra config.json keys; the k/v projections of `dropped_layers` removed (layers that
    read another layer's KV have none)."""
    write_tiny_llama(path, tokenizer)
    config = json.loads((path / "config.json").read_text())
    config.update(config_extra)
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    dropped = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in dropped_layers for p in "kv"}
    save_file({k: v.contiguous() for k, v in weights.items() if k not in dropped}, path / "model.safetensors")
    return path


def _spec(heads_dir, tree="default"):
    spec = {"method": "medusa", "num_speculative_tokens": 3, "model": str(heads_dir)}
    return spec if tree is None else {**spec, "tree": tree}


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_tree_with_a_quantized_kv_cache_is_refused_at_construction(tiny_llama_dir, heads_dir, kv_cache_dtype):
    with pytest.raises(ValueError, match=f"layer 0 has a quantized KV cache \\({kv_cache_dtype}.*drop 'tree'"):
        _make_llm(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype, speculative_config=_spec(heads_dir))
    llm = _make_llm(tiny_llama_dir, kv_cache_dtype=kv_cache_dtype, speculative_config=_spec(heads_dir, tree=None))
    assert len(_generate(llm, [[5, 6, 7]], _greedy())[0].token_ids) > 0  # chains still verify on it


def test_tree_with_sliding_window_layers_is_refused_at_construction(tmp_path, tiny_tokenizer, heads_dir):
    model = _edited_llama(tmp_path / "swa", tiny_tokenizer, {"sliding_window": 8})
    with pytest.raises(ValueError, match="layer 0 has sliding-window attention"):
        _make_llm(model, speculative_config=_spec(heads_dir))
    _make_llm(model, speculative_config=_spec(heads_dir, tree=None))


def test_tree_layer_refusal_names_each_unsupported_cache():
    """The per-layer check the start-up refusal and the step share (an MLA model's latent cache included)."""
    full = FullAttentionSpec(4, 2, 16, torch.float32)
    paged = PagedKVCache(full, torch.zeros(3, 2, 4, 16), torch.zeros(3, 2, 4, 16))
    assert tree_layer_refusal(paged) is None
    assert tree_layer_refusal(paged, window_size=8) == "sliding-window attention"
    window = SlidingWindowSpec(4, 2, 16, torch.float32, 8)
    assert tree_layer_refusal(PagedKVCache(window, paged.key_cache, paged.value_cache)) == "sliding-window attention"
    latent = LatentKVCache(MLAAttentionSpec(4, 32, torch.float32), torch.zeros(3, 4, 32))
    assert tree_layer_refusal(latent) == "a latent (MLA) KV cache"


def test_tree_on_kv_sharing_layers_matches_plain_decoding(tmp_path, tiny_tokenizer, heads_dir):
    model = _edited_llama(tmp_path / "shared", tiny_tokenizer, {"kv_sharing_layers": {"1": 0}}, dropped_layers=(1,))
    prompts = _tie_free_prompts(model, len(tiny_tokenizer), _greedy(), lens=[3, 9])
    ref = _generate(_make_llm(model), prompts, _greedy())
    llm = _make_llm(model, speculative_config=_spec(heads_dir, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]))
    outs = _generate(llm, prompts, _greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0 and llm.llm_engine.spec_stats.num_proposer_errors == 0
