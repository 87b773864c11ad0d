"""BlockManager / Scheduler with a sliding window through the pybind API: the null block, dropping the blocks
that left the window, prefix hits that need only the window's blocks, bad windows refused."""
import pytest

from pagellm import _C


def test_bad_window_raises_value_error():
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        _C.BlockManager(8, block_size=4, sliding_window=-1)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        _C.BlockManager(1, block_size=4, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window"):
        _C.Scheduler(num_blocks=8, block_size=4, sliding_window=-3)


def test_drop_outside_window_then_hit_from_the_right():
    bm = _C.BlockManager(12, block_size=4, watermark=0.0, sliding_window=6)
    assert (bm.null_block, bm.sliding_window, bm.num_free_blocks) == (0, 6, 11)
    prompt = list(range(100, 124))  # 6 full blocks
    assert bm.allocate("a", prompt) == 0
    bm.cache_full_blocks("a", prompt, 24)
    bm.drop_outside_window("a", 24)  # position 24 reads keys 19..24: blocks 4 and 5
    table = bm.get_block_table("a")
    assert table[:4] == [0, 0, 0, 0] and 0 not in table[4:] and len(table) == 6
    assert bm.num_live_blocks("a") == 2
    assert bm.num_free_blocks == 9 and bm.usage == pytest.approx(2 / 11)
    assert bm.free("a")
    # the same prompt plus one token: a 24-token hit built on blocks 4 and 5 alone
    assert bm.allocate("b", prompt + [7]) == 24
    assert bm.get_block_table("b")[:4] == [0, 0, 0, 0]
    assert bm.num_live_blocks("b") == 3
    assert bm.get_ref_count(0) == 1  # the null block: the manager's reference only
    assert bm.free("b") and bm.num_free_blocks == 11


def test_scheduler_bounds_a_decoding_request():
    s = _C.Scheduler(max_num_batched_tokens=16, max_model_len=256, num_blocks=12, block_size=4,
                     enable_prefix_caching=False, watermark=0.0, sliding_window=6)
    s.add_request("r", list(range(40)))
    live = []
    for step in range(80):
        out = s.schedule()
        sample = [1 if out.do_sample[i] else 0 for i in range(out.num_reqs)]
        s.update(out, sample, [5] * sum(sample))
        live.append(s.get_num_live_blocks("r"))
    assert s.get_request("r").num_tokens == 40 + 80 - 2  # two 16-token chunks, then a token per step
    assert max(live) <= 6 and max(live[3:]) <= 3  # chunk of 16 + 5 keys; then ceil(6 / 4) + 1
    assert s.abort("r") and s.num_free_blocks == 11
