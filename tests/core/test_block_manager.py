"""BlockManager through the pybind API: allocation, watermark, prefix reuse, fork + copy-on-write."""
import pytest

from pagellm import _C


def test_bad_config_raises_value_error():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        _C.BlockManager(0)
    with pytest.raises(ValueError, match="block_size"):
        _C.BlockManager(8, block_size=12)
    with pytest.raises(ValueError, match="watermark"):
        _C.BlockManager(8, watermark=1.5)


def test_allocate_free_idempotent():
    bm = _C.BlockManager(10, block_size=4, watermark=0.0)
    prompt = list(range(10))
    assert bm.allocate("a", prompt) == 0
    table = bm.get_block_table("a")
    assert len(table) == -(-len(prompt) // 4)
    assert bm.num_free_blocks == 10 - len(table)
    assert bm.usage == pytest.approx(len(table) / 10)
    assert bm.num_tail_waste_slots == len(table) * 4 - len(prompt)
    with pytest.raises(ValueError):
        bm.allocate("a", prompt)  # duplicate id: nothing changes
    assert bm.num_free_blocks == 10 - len(table)
    assert bm.free("a") is True
    assert bm.free("a") is False
    assert bm.num_free_blocks == 10
    with pytest.raises(KeyError):
        bm.get_block_table("a")


def test_watermark_blocks_admission_not_growth():
    bm = _C.BlockManager(10, block_size=4, enable_prefix_caching=False, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.allocate("a", list(range(28))) == 0  # 7 blocks, 3 free
    assert not bm.can_allocate(list(range(8)))  # would leave 1 < 2
    assert bm.allocate("b", list(range(8))) is None
    assert bm.num_free_blocks == 3
    assert bm.append_slots("a", 28, 12)  # growth may use the watermark
    assert bm.num_free_blocks == 0
    assert not bm.append_slots("a", 40, 1)


def test_prefix_reuse_across_requests():
    bs = 4
    bm = _C.BlockManager(32, block_size=bs, watermark=0.0)
    shared = list(range(100, 100 + 3 * bs))
    bm.allocate("a", shared + [1, 2])
    bm.cache_full_blocks("a", shared + [1, 2], len(shared) + 2)
    assert bm.num_cached_blocks == 3
    hit = bm.allocate("b", shared + [7, 8, 9])
    assert hit == len(shared)
    assert bm.get_block_table("b")[:3] == bm.get_block_table("a")[:3]
    assert all(bm.get_ref_count(b) == 2 for b in bm.get_block_table("a")[:3])
    assert bm.prefix_cache_hits == len(shared)
    assert bm.prefix_cache_queries == len(shared) + 2 + len(shared) + 3
    # Different extra key (cache salt / LoRA): no reuse.
    assert bm.allocate("c", shared + [7], extra_key=5) == 0
    # The whole prompt cached: the block holding the final token is recomputed.
    assert bm.allocate("d", shared) == len(shared) - bs
    # Freed cached blocks stay reusable until evicted.
    for rid in ("a", "b", "c", "d"):
        bm.free(rid)
    assert bm.allocate("e", shared + [0]) == len(shared)
    assert bm.reset_prefix_cache() is True
    assert bm.num_cached_blocks == 0


def test_fork_and_copy_on_write():
    bs = 4
    bm = _C.BlockManager(16, block_size=bs, watermark=0.0)
    bm.allocate("p", list(range(6)))  # [full][2 of 4]
    bm.fork("p", "c")
    shared = bm.get_block_table("p")
    assert bm.get_block_table("c") == shared
    assert [bm.get_ref_count(b) for b in shared] == [2, 2]
    assert bm.append_slots("p", 6, 1)  # writes position 6 into the shared partial block
    new = bm.get_block_table("p")
    assert new[0] == shared[0] and new[1] != shared[1]
    assert bm.append_slots("c", 6, 1)  # now sole owner: in place
    assert bm.get_block_table("c") == shared
    assert bm.take_cow_copies() == [(shared[1], new[1])]
    assert bm.take_cow_copies() == []
    assert bm.get_ref_count(shared[1]) == 1
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 16


def test_lookahead_and_shrink():
    bm = _C.BlockManager(16, block_size=4, enable_prefix_caching=False, watermark=0.0)
    bm.allocate("a", list(range(5)), num_lookahead_tokens=7)
    assert len(bm.get_block_table("a")) == 3
    bm.shrink("a", 6)
    assert len(bm.get_block_table("a")) == 2
    assert bm.num_free_blocks == 14
