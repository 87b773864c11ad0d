"""pagellm.kv_cache: per-layer specs, grouping, sizing from memory, allocation, block copies, shared layers."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import ops
from pagellm.attention import AttentionLayerSpec, AttentionMetadata, get_attention_backend_cls
from pagellm.kv_cache import (
    KVCacheConfig,
    KVCaches,
    LatentKVCache,
    PagedKVCache,
    allocate_kv_caches,
    bytes_per_block,
    determine_num_blocks,
    group_kv_cache_specs,
    make_kv_cache_config,
)
from pagellm.kv_cache import sizing as sizing_module
from pagellm.kv_cache.spec import FullAttentionSpec, MLAAttentionSpec, SharedKVSpec, SlidingWindowSpec

GiB = 1 << 30
BF16, F32 = torch.bfloat16, torch.float32


def _mixed_specs():
    """Full + sliding (one group), a layer sharing layer 0, an int8 full layer, an fp8 MLA layer."""
    return {
        0: FullAttentionSpec(16, 2, 64, BF16),
        1: SlidingWindowSpec(16, 2, 64, BF16, 32),
        2: SharedKVSpec(0),
        3: FullAttentionSpec(16, 4, 32, "int8"),
        4: MLAAttentionSpec(16, 96, "fp8_e4m3"),
    }


def _config(specs, num_blocks):
    return KVCacheConfig(num_blocks=num_blocks, groups=group_kv_cache_specs(specs), layer_specs=specs)


def _allocated_bytes(kv: KVCaches) -> int:
    return sum(t.numel() * t.element_size() for t in kv.tensors())


# ------------------------------------------------------------------------------------------ specs
@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(block_size=24), r"power of two in \[1, 256\]"),
    (dict(block_size=512), r"power of two in \[1, 256\]"),
    (dict(block_size=True), "block_size must be an integer"),
    (dict(num_kv_heads=0), "num_kv_heads must be an integer >= 1"),
    (dict(head_dim=-1), "head_dim must be an integer >= 1"),
    (dict(dtype=torch.int32), "KV-cache dtype must be one of .*'int8', 'fp8_e4m3'"),
    (dict(dtype="int4"), "KV-cache dtype must be one of"),
    (dict(dtype="bfloat16"), "KV-cache dtype must be one of"),
])
def test_full_spec_validation(kwargs, match):
    args = dict(block_size=16, num_kv_heads=2, head_dim=64, dtype=BF16) | kwargs
    with pytest.raises(ValueError, match=match):
        FullAttentionSpec(**args)


def test_other_spec_validation():
    with pytest.raises(ValueError, match="window_size must be an integer >= 1"):
        SlidingWindowSpec(16, 2, 64, BF16, 0)
    with pytest.raises(ValueError, match="latent_dim must be an integer >= 1"):
        MLAAttentionSpec(16, 0, BF16)
    with pytest.raises(ValueError, match=r"power of two"):
        MLAAttentionSpec(12, 64, BF16)
    with pytest.raises(ValueError, match="target_layer must be an integer >= 0"):
        SharedKVSpec(-1)
    with pytest.raises(ValueError, match="KV-cache dtype"):
        MLAAttentionSpec(16, 64, "fp4")


def test_spec_dtypes_and_page_sizes_by_hand():
    full = FullAttentionSpec(16, 2, 64, BF16)
    assert (full.is_quantized, full.storage_dtype) == (False, BF16)
    assert full.page_size_bytes == 2 * (2 * 16 * 64) * 2  # key + value, bf16
    int8 = FullAttentionSpec(16, 4, 32, "int8")
    assert (int8.is_quantized, int8.storage_dtype) == (True, torch.int8)
    # key + value: int8 values + one fp32 scale per row (token, kv head)
    assert int8.page_size_bytes == 2 * (4 * 16 * 32 * 1 + 4 * 16 * 4)
    assert int8.scale_shape(7) == (7, 4, 16)
    fp8 = FullAttentionSpec(8, 1, 128, "fp8_e4m3")
    assert fp8.storage_dtype == torch.float8_e4m3fn
    assert fp8.page_size_bytes == 2 * (8 * 128 + 8 * 4)
    assert SlidingWindowSpec(16, 2, 64, BF16, 8).page_size_bytes == full.page_size_bytes
    assert MLAAttentionSpec(16, 576, F32).page_size_bytes == 16 * 576 * 4  # one latent, no separate value
    assert MLAAttentionSpec(16, 576, "int8").page_size_bytes == 16 * 576 + 16 * 4  # one scale per token
    assert SharedKVSpec(0).page_size_bytes == 0


# ---------------------------------------------------------------------------------------- groups
def test_all_full_layers_are_one_group():
    specs = {i: FullAttentionSpec(16, 2, 64, BF16) for i in range(4)}
    (group,) = group_kv_cache_specs(specs)
    assert group.layer_ids == group.allocated_layer_ids == (0, 1, 2, 3)
    assert group.spec == specs[0] and group.shared_layer_ids == ()
    # the old single-spec formula: 2 (K, V) * layers * heads * block_size * head_dim * element size
    assert bytes_per_block([group]) == 2 * 4 * 2 * 16 * 64 * 2


def test_full_and_sliding_layers_share_one_group_and_keep_their_windows():
    specs = {0: FullAttentionSpec(16, 2, 64, BF16), 1: SlidingWindowSpec(16, 2, 64, BF16, 8),
             2: SlidingWindowSpec(16, 2, 64, BF16, 8)}
    config = _config(specs, 10)
    assert config.num_groups == 1 and config.num_block_tables == 1
    assert config.groups[0].layer_ids == (0, 1, 2)
    assert config.groups[0].spec == FullAttentionSpec(16, 2, 64, BF16)  # the page, without the window
    assert config.layer_specs[1].window_size == 8
    assert config.bytes_per_block == 3 * specs[0].page_size_bytes


def test_a_pipeline_stage_of_sliding_layers_keeps_every_block():
    """A stage whose own layers all slide must not hand the window to the driver's one block manager: the
    other stages' layers may be full attention (Gemma 2 at PP=2 gave wrong logprobs before this)."""
    specs = {3: SlidingWindowSpec(16, 2, 64, BF16, 8), 5: SlidingWindowSpec(16, 2, 64, BF16, 8)}
    cpu = torch.device("cpu")
    whole = make_kv_cache_config(specs, cpu, 512, 4, num_blocks_override=64)
    stage = make_kv_cache_config(specs, cpu, 512, 4, num_blocks_override=64, free_sliding_blocks=False)
    assert whole.sliding_window == 8 and stage.sliding_window == 0
    assert stage.num_blocks == 64 and stage.groups == whole.groups


def test_shared_layer_joins_its_target_group_and_allocates_nothing():
    specs = {0: FullAttentionSpec(16, 2, 64, BF16), 1: SharedKVSpec(0), 2: FullAttentionSpec(16, 2, 64, BF16)}
    (group,) = group_kv_cache_specs(specs)
    assert group.layer_ids == (0, 1, 2)
    assert group.shared_layer_ids == (1,) and group.allocated_layer_ids == (0, 2)
    assert group.page_size_bytes == 2 * specs[0].page_size_bytes


def test_mla_and_other_dtypes_are_their_own_groups():
    groups = group_kv_cache_specs(_mixed_specs())
    assert [g.layer_ids for g in groups] == [(0, 1, 2), (3,), (4,)]
    assert [g.shared_layer_ids for g in groups] == [(2,), (), ()]
    assert groups[2].spec == MLAAttentionSpec(16, 96, "fp8_e4m3")


def test_grouping_rejects_bad_input():
    with pytest.raises(ValueError, match="layer 1 shares the cache of layer 5, which does not exist"):
        group_kv_cache_specs({0: FullAttentionSpec(16, 2, 64, BF16), 1: SharedKVSpec(5)})
    with pytest.raises(ValueError, match="itself shared; point at the layer that owns the cache \\(layer 0\\)"):
        group_kv_cache_specs({0: FullAttentionSpec(16, 2, 64, BF16), 1: SharedKVSpec(0), 2: SharedKVSpec(1)})
    with pytest.raises(TypeError, match="expected a FullAttentionSpec"):
        group_kv_cache_specs({0: "full"})
    with pytest.raises(ValueError, match="non-empty mapping"):
        group_kv_cache_specs({})
    with pytest.raises(ValueError, match="layer ids must be integers >= 0"):
        group_kv_cache_specs({-1: FullAttentionSpec(16, 2, 64, BF16)})


def test_groups_needing_several_block_tables_are_refused():
    specs = {0: FullAttentionSpec(16, 2, 64, BF16), 1: MLAAttentionSpec(32, 64, BF16)}
    groups = group_kv_cache_specs(specs)
    assert len(groups) == 2
    with pytest.raises(ValueError, match=r"needs 2 block tables per request \(block sizes \[16, 32\]\)"):
        make_kv_cache_config(specs, torch.device("cpu"), 64, 2, kv_cache_memory_gb=0.01)
    assert KVCacheConfig(4, groups, specs).num_block_tables == 2
    # MLA + full with one block size share the block table (one block id indexes every layer)
    same = {0: FullAttentionSpec(16, 2, 64, BF16), 1: MLAAttentionSpec(16, 64, BF16)}
    assert make_kv_cache_config(same, torch.device("cpu"), 64, 2, kv_cache_memory_gb=0.01).num_block_tables == 1


def test_config_validation():
    groups = group_kv_cache_specs({0: FullAttentionSpec(16, 2, 64, BF16)})
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1"):
        KVCacheConfig(0, groups, {0: FullAttentionSpec(16, 2, 64, BF16)})
    with pytest.raises(ValueError, match="at least one group"):
        KVCacheConfig(4, (), {})


# ---------------------------------------------------------------------------------------- sizing
def _hand_bytes_per_block() -> int:
    """_mixed_specs() per block, from the shapes: layers 0 and 1 bf16 K+V, layer 2 nothing,
    layer 3 int8 K+V with one fp32 scale per row (token, kv head) each, layer 4 an fp8 latent with one
    fp32 scale per token."""
    return 2 * (2 * (2 * 16 * 64) * 2) + 0 + 2 * (4 * 16 * 32 * 1 + 4 * 16 * 4) + (16 * 96 * 1 + 16 * 4)


def test_sizing_counts_every_group_and_the_scales():
    specs = _mixed_specs()
    groups = group_kv_cache_specs(specs)
    per_block = _hand_bytes_per_block()
    assert bytes_per_block(groups) == per_block
    # and the allocation agrees byte for byte
    assert _allocated_bytes(allocate_kv_caches(_config(specs, 3), "cpu")) == 3 * per_block

    max_len, max_seqs = 256, 64
    n = determine_num_blocks(groups, "cpu", max_len, max_seqs, kv_cache_memory_gb=0.01)
    assert n == min(int(0.01 * GiB) // per_block, math.ceil(max_len / 16) * max_seqs + 1)
    assert n < math.ceil(max_len / 16) * max_seqs + 1  # the budget, not the cap, decided
    # capped at what max_num_seqs max-length requests can use (+1 null block)
    assert determine_num_blocks(groups, "cpu", max_len, 2, kv_cache_memory_gb=0.01) == 16 * 2 + 1
    assert determine_num_blocks(groups, "cpu", max_len, 2, num_blocks_override=500) == 500


def test_sizing_error_suggests_settings():
    groups = group_kv_cache_specs(_mixed_specs())
    per_block = _hand_bytes_per_block()
    gb = 0.0001
    fit = int(gb * GiB) // per_block
    need_gb = (128 // 16 + 1) * per_block / GiB
    msg = (rf"cannot hold one request of max_model_len=128 tokens \(9 blocks needed\)\. "
           rf"Set kv_cache_memory_gb >= {need_gb:.3f} or max_model_len <= {(fit - 1) * 16}\.")
    with pytest.raises(ValueError, match=msg):
        determine_num_blocks(groups, "cpu", 128, 4, kv_cache_memory_gb=gb)
    with pytest.raises(ValueError, match=r"num_kv_blocks: 3 blocks of 16 tokens"):
        determine_num_blocks(groups, "cpu", 128, 4, num_blocks_override=3)


def test_sizing_from_free_memory_and_the_cpu_cap(monkeypatch):
    groups = group_kv_cache_specs(_mixed_specs())
    per_block = _hand_bytes_per_block()
    monkeypatch.setattr(sizing_module, "available_memory_bytes", lambda device: GiB // 8)
    assert determine_num_blocks(groups, "cpu", 64, 10**6, kv_cache_fraction=0.5) == int(GiB // 8 * 0.5) // per_block
    monkeypatch.setattr(sizing_module, "available_memory_bytes", lambda device: 100 * GiB)
    capped = sizing_module.CPU_DEFAULT_MAX_GB * GiB // per_block
    assert determine_num_blocks(groups, "cpu", 64, 10**6, kv_cache_fraction=0.9) == capped
    # an explicit budget is not capped
    assert determine_num_blocks(groups, "cpu", 64, 10**6, kv_cache_memory_gb=5.0) == int(5.0 * GiB) // per_block


# ------------------------------------------------------------------------------------ allocation
def test_allocation_shapes_dtypes_and_scales():
    kv = allocate_kv_caches(_config(_mixed_specs(), 5), torch.device("cpu"))
    assert len(kv) == 5 and kv.layer_ids == [0, 1, 2, 3, 4] and kv.num_blocks == 5
    for i in (0, 1):
        c = kv[i]
        assert isinstance(c, PagedKVCache) and c.k_scale is None and c.v_scale is None
        assert c.key_cache.shape == c.value_cache.shape == (5, 2, 16, 64) and c.key_cache.dtype == BF16
    assert kv[1].spec.window_size == 32
    q = kv[3]
    assert q.key_cache.shape == q.value_cache.shape == (5, 4, 16, 32) and q.key_cache.dtype == torch.int8
    assert q.k_scale.shape == q.v_scale.shape == (5, 4, 16) and q.k_scale.dtype == torch.float32
    lat = kv[4]
    assert isinstance(lat, LatentKVCache)
    assert lat.cache.shape == (5, 16, 96) and lat.cache.dtype == torch.float8_e4m3fn
    assert lat.scale.shape == (5, 16) and lat.scale.dtype == torch.float32
    assert all(not t.view(torch.uint8).any() for t in kv.tensors())  # zeros
    assert len(list(kv.tensors())) == 2 + 2 + 4 + 2  # the shared layer adds nothing


def test_shared_layer_gets_its_target_object():
    kv = allocate_kv_caches(_config(_mixed_specs(), 4), "cpu")
    assert kv[2] is kv[0]
    assert len({id(t) for t in kv.tensors()}) == len(list(kv.tensors()))
    with pytest.raises(KeyError, match="no KV cache for layer 9"):
        kv[9]


def test_cache_objects_validate():
    spec = FullAttentionSpec(16, 2, 64, "int8")
    kc = torch.zeros(3, 2, 16, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="k_scale is required for the quantized cache dtype 'int8'"):
        PagedKVCache(spec, kc, kc.clone())
    with pytest.raises(TypeError, match="key_cache must have dtype torch.int8"):
        PagedKVCache(spec, kc.float(), kc.float())
    with pytest.raises(ValueError, match=r"k_scale must be a contiguous tensor of shape \[num_blocks, 2, 16\]"):
        PagedKVCache(spec, kc, kc.clone(), torch.zeros(3, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="v_scale must have num_blocks = 3 rows"):
        PagedKVCache(spec, kc, kc.clone(), torch.zeros(3, 2, 16), torch.zeros(4, 2, 16))
    with pytest.raises(ValueError, match="must be None for the float cache dtype"):
        PagedKVCache(FullAttentionSpec(16, 2, 64, F32), kc.float(), kc.float(), torch.zeros(3, 2, 16),
                     torch.zeros(3, 2, 16))
    f = PagedKVCache(FullAttentionSpec(16, 2, 64, F32), kc.float(), kc.float())
    g = PagedKVCache(FullAttentionSpec(16, 2, 64, F32), torch.zeros(4, 2, 16, 64), torch.zeros(4, 2, 16, 64))
    with pytest.raises(ValueError, match="same num_blocks"):
        KVCaches({0: f, 1: g})
    with pytest.raises(ValueError, match="shared layer 1 targets layer 7, which owns no cache"):
        KVCaches({0: f}, {1: 7})


# ----------------------------------------------------------------------------------- copy_blocks
def _fill_random(kv: KVCaches) -> None:
    g = torch.Generator().manual_seed(0)
    for t in kv.tensors():
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-128, 128, t.shape, generator=g, dtype=torch.int8))
        else:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("compiled", [True, False])
def test_copy_blocks_copies_keys_values_latents_and_scales(compiled, monkeypatch):
    if compiled and not ops.ops_available()[0]:
        pytest.skip(f"the compiled ops are not built: {ops.ops_available()[1]}")
    calls = []
    if compiled:
        real = ops.copy_blocks
        monkeypatch.setattr(ops, "copy_blocks", lambda k, v, m: (calls.append(len(k)), real(k, v, m)))
    else:
        monkeypatch.setattr(ops, "ops_available", lambda: (False, "disabled by the test"))
    specs = _mixed_specs() | {5: FullAttentionSpec(16, 2, 64, BF16)}
    kv = allocate_kv_caches(_config(specs, 6), "cpu")
    _fill_random(kv)
    before = [t.clone() for t in kv.tensors()]
    mapping = torch.tensor([[1, 4], [3, 0], [2, 5]], dtype=torch.int64)
    kv.copy_blocks(mapping)
    for old, new in zip(before, kv.tensors()):
        expected = old.clone()
        expected[mapping[:, 1]] = old[mapping[:, 0]]
        assert torch.equal(_raw(new), _raw(expected))
        assert not torch.equal(_raw(new), _raw(old))  # something was copied in every tensor
    # the compiled op moved the paged caches, one call per (shape, dtype): the bf16 layers 0, 1, 5, the int8
    # layer 3, its scales (as [num_blocks, heads, block_size, 1] pages); the fp8 latent went through the reference
    assert calls == ([3, 1, 1] if compiled else [])


# ------------------------------------------------------------------------------ models, backends
def test_model_kv_cache_specs_follow_the_attention_layers():
    import transformers as tf

    from pagellm.models.qwen2 import Qwen2ForCausalLM

    config = tf.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                            max_window_layers=1)
    model = Qwen2ForCausalLM(config, torch.float32)
    specs = model.kv_cache_specs(16, torch.float32)
    assert specs == {0: FullAttentionSpec(16, 2, 16, F32), 1: SlidingWindowSpec(16, 2, 16, F32, 8),
                     2: SlidingWindowSpec(16, 2, 16, F32, 8)}
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.window_sizes) == (3, 2, 16, [-1, 8, 8])
    assert model.kv_cache_specs(16, "int8")[1].dtype == "int8"
    assert len(group_kv_cache_specs(specs)) == 1


def _one_token_step(backend):
    md = AttentionMetadata(num_reqs=1, num_tokens=1, num_decode_reqs=1, max_query_len=1, max_seq_len=1,
                           slot_mapping=torch.tensor([0]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                           seq_lens=torch.tensor([1], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
    backend.plan(md)
    layer = AttentionLayerSpec(0, 2, 2, 64, scale=0.125)
    q, k = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    return layer, q, k


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_backends_run_on_quantized_caches(backend_name, dtype):
    cls = get_attention_backend_cls(backend_name)
    ok, why = cls.is_available(torch.device("cpu"))
    if not ok:
        pytest.skip(why)
    backend = cls(torch.device("cpu"))
    layer, q, k = _one_token_step(backend)
    latent = allocate_kv_caches(_config({0: MLAAttentionSpec(16, 64, F32)}, 2), "cpu")
    with pytest.raises(TypeError, match="takes a PagedKVCache, got LatentKVCache"):
        backend.forward(layer, q, k, k, latent[0])
    # the step on a quantized cache writes the token's key into slot 0 as stored values + a per-row scale
    kv = allocate_kv_caches(_config({0: FullAttentionSpec(16, 2, 64, dtype)}, 2), "cpu")
    out = backend.forward(layer, q, k, k, kv[0])
    c = kv[0]
    stored, scale = c.key_cache[0, :, 0].float(), c.k_scale[0, :, 0]
    torch.testing.assert_close(scale, k[0].abs().amax(-1) / (127 if dtype == "int8" else 448))
    back = stored * scale[:, None]
    rel = 1 / 254 if dtype == "int8" else 1 / 16
    assert ((back - k[0]).abs() <= k[0].abs().amax(-1, keepdim=True) * rel * 1.001).all()
    assert torch.equal(c.v_scale[0, :, 0], scale) and not c.k_scale[1:].any() and not c.k_scale[0, :, 1:].any()
    torch.testing.assert_close(out, back.expand_as(q))  # one key: attention returns its (dequantized) value
    # the same step on a float cache writes the key itself
    kv = allocate_kv_caches(_config({0: FullAttentionSpec(16, 2, 64, F32)}, 2), "cpu")
    out = backend.forward(layer, q, k, k, kv[0])
    assert torch.equal(kv[0].key_cache[0, :, 0], k[0])
    torch.testing.assert_close(out, k.expand_as(q))  # one key: attention returns its value
