"""Scheduler through the pybind API: admission, chunked prefill, preemption, prefix reuse, fork, errors."""
import numpy as np
import pytest

from pagellm import _C


def make(**kw):
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=64, block_size=4,
                watermark=0.0)
    args.update(kw)
    return _C.Scheduler(**args)


def step(s, token=7, finished=()):
    """schedule() + a stub model that samples `token` for every sampling row + update()."""
    out = s.schedule()
    n = out.do_sample.astype(np.int32)
    s.update(out, n, np.full(int(n.sum()), token, dtype=np.int64), list(finished))
    return out


def test_admission_and_output_arrays():
    s = make()
    s.add_request("a", list(range(10)), arrival_time=0.0)
    s.add_request("b", list(range(20, 25)), arrival_time=1.0)
    assert s.num_waiting == 2
    out = s.schedule()
    assert out.request_ids == ["a", "b"]
    assert out.num_scheduled_tokens.tolist() == [10, 5]
    assert out.query_start_loc.tolist() == [0, 10, 15]
    assert out.input_ids.tolist() == list(range(10)) + list(range(20, 25))
    assert out.positions.tolist() == list(range(10)) + list(range(5))
    bt = out.block_tables
    assert bt.dtype == np.int32 and bt.shape == (2, out.max_blocks_in_batch)
    expect = [bt[0, p // 4] * 4 + p % 4 for p in range(10)] + [bt[1, p // 4] * 4 + p % 4 for p in range(5)]
    assert out.slot_mapping.tolist() == expect
    assert out.do_sample.dtype == np.bool_ and out.do_sample.all()
    assert out.logits_indices.tolist() == [9, 14]
    assert out.num_decode_reqs == 0
    s.update(out, np.array([1, 1], np.int32), np.array([100, 200], np.int64))
    assert s.get_output_token_ids("a") == [100]
    assert s.get_num_computed_tokens("a") == 10
    out2 = step(s)
    assert out2.num_decode_reqs == 2
    assert out2.input_ids.tolist() == [100, 200]
    assert out2.positions.tolist() == [10, 5]


def test_chunked_prefill_batched_with_decodes():
    budget = 8
    s = make(max_num_batched_tokens=budget)
    s.add_request("dec", [1, 2, 3], arrival_time=0.0)
    step(s)
    s.add_request("long", list(range(100, 120)), arrival_time=1.0)
    out = step(s)
    assert out.request_ids == ["dec", "long"]  # decode first
    assert out.num_scheduled_tokens.tolist() == [1, budget - 1]
    assert out.do_sample.tolist() == [True, False]
    assert s.get_num_computed_tokens("long") == budget - 1
    assert s.get_output_token_ids("long") == []
    while s.get_num_computed_tokens("long") < 20:
        step(s)
    assert len(s.get_output_token_ids("long")) == 1


def test_chunked_prefill_off_rejects_and_waits():
    s = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add_request("big", list(range(9)))
    s.add_request("a", list(range(6)))
    s.add_request("b", list(range(6)))
    out = s.schedule()
    assert out.request_ids == ["a"]  # b does not fit the remaining budget: it waits whole
    assert s.num_waiting == 1


def test_preemption_by_recompute():
    bs, blocks = 4, 4
    s = make(num_blocks=blocks, block_size=bs)
    s.add_request("old", list(range(7)), arrival_time=0.0)
    s.add_request("new", list(range(50, 57)), arrival_time=1.0)
    step(s)
    step(s)  # each now 9 tokens, 8 computed: fills 2 blocks each
    assert s.num_free_blocks == 0
    out = s.schedule()
    assert out.preempted_request_ids == ["new"]
    assert out.request_ids == ["old"]
    assert s.get_request_status("new") == _C.RequestStatus.PREEMPTED
    r = s.get_request("new")
    assert r.num_computed_tokens == 0 and r.num_preemptions == 1
    assert r.output_token_ids == [7, 7]  # outputs survive, re-prefilled on resume
    s.update(out, np.array([1], np.int32), np.array([7], np.int64), [("old", _C.RequestStatus.FINISHED_STOPPED)])
    out = s.schedule()
    assert out.request_ids == ["new"]
    # prompt + outputs are recomputed, minus whatever of its freed blocks survived in the prefix cache
    # (its tail blocks were evicted first by "old"'s growth).
    full = list(range(50, 57)) + [7, 7]
    cached = int(out.num_computed_tokens[0])
    assert cached == s.get_request("new").num_cached_tokens and cached % bs == 0 and cached < len(full)
    assert out.num_scheduled_tokens.tolist() == [len(full) - cached]
    assert out.input_ids.tolist() == full[cached:]


def test_prefix_reuse_across_requests():
    bs = 4
    s = make(block_size=bs)
    system = list(range(500, 500 + 4 * bs))
    s.add_request("a", system + [1, 2, 3])
    step(s)
    s.add_request("b", system + [9])
    out = step(s)
    row = out.request_ids.index("b")
    assert out.num_computed_tokens[row] == len(system)
    assert out.num_scheduled_tokens[row] == 1
    assert s.get_request("b").num_cached_tokens == len(system)
    assert s.prefix_cache_hits == len(system)
    assert s.get_block_table("b")[:4] == s.get_block_table("a")[:4]


def test_fork_copy_on_write_for_n_sampling():
    s = make()
    s.add_request("p", list(range(6)))
    out = s.schedule()
    s.fork("p", "p#1")  # joins this step as an extra sampling row
    s.update(out, np.array([1, 1], np.int32), np.array([11, 22], np.int64))
    assert s.get_output_token_ids("p") == [11]
    assert s.get_output_token_ids("p#1") == [22]
    assert s.get_block_table("p") == s.get_block_table("p#1")
    out = s.schedule()
    assert sorted(out.request_ids) == ["p", "p#1"]
    assert out.cow_copies.shape == (1, 2)
    src, dst = out.cow_copies[0]
    assert src in s.get_block_table("p") + s.get_block_table("p#1")
    assert dst in s.get_block_table("p") + s.get_block_table("p#1")
    assert len(set(out.slot_mapping.tolist())) == 2
    assert out.input_ids.tolist() == [11, 22] or out.input_ids.tolist() == [22, 11]


def test_fork_rules():
    s = make(max_num_batched_tokens=4)
    s.add_request("p", list(range(10)))
    with pytest.raises(ValueError, match="RUNNING"):
        s.fork("p", "c")
    with pytest.raises(KeyError):
        s.fork("missing", "c")
    out = s.schedule()
    with pytest.raises(ValueError, match="mid-prefill"):
        s.fork("p", "c")
    s.update(out, np.zeros(1, np.int32), np.zeros(0, np.int64))


def test_bad_input_leaves_state_untouched():
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request("a", list(range(17)))
    with pytest.raises(ValueError):
        s.add_request("a", [])
    s.add_request("a", list(range(16)))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request("a", [1])
    assert s.num_waiting == 1 and s.get_request("a").num_tokens == 16
    with pytest.raises(ValueError, match="block_size"):
        make(block_size=24)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        make(num_blocks=0)
    with pytest.raises(ValueError, match="policy"):
        make(policy="lifo")
    out = s.schedule()
    with pytest.raises(ValueError):
        s.update(out, np.array([2], np.int32), np.array([1, 2], np.int64))
    with pytest.raises(ValueError):
        s.update(out, np.array([1], np.int32), np.array([1], np.int64), [("a", _C.RequestStatus.RUNNING)])
    assert s.get_output_token_ids("a") == []
    s.update(out, np.array([1], np.int32), np.array([1], np.int64))
    assert s.get_output_token_ids("a") == [1]


def test_abort_unknown_finished_and_live():
    s = make()
    assert s.abort("nope") is False
    s.add_request("a", list(range(5)))
    s.add_request("b", list(range(5)))
    out = step(s, finished=[("b", _C.RequestStatus.FINISHED_STOPPED)])
    assert "b" in out.request_ids
    assert s.abort("b") is False  # already finished
    used = s.num_blocks - s.num_free_blocks
    assert used > 0
    assert s.abort("a") is True
    assert s.num_free_blocks == s.num_blocks
    assert not s.has_unfinished_requests()


def test_priority_policy_and_timers():
    s = make(policy="priority", max_num_batched_tokens=4)
    s.add_request("low", [1, 2, 3, 4], arrival_time=0.0, priority=3)
    s.add_request("high", [5, 6, 7, 8], arrival_time=1.0, priority=0)
    out = step(s)
    assert out.request_ids == ["high"]
    assert s.last_schedule_us > 0 and s.last_update_us > 0 and s.num_steps == 1


def test_draft_tokens_through_the_bindings():
    s = make(num_lookahead_tokens=3)
    s.add_request("a", [1, 2, 3, 4, 5], arrival_time=0.0, max_tokens=20)
    s.add_request("b", [9, 8], arrival_time=1.0)
    assert s.get_request("a").max_tokens == 20 and s.get_request("b").max_tokens is None
    with pytest.raises(ValueError):
        s.add_request("c", [1], max_tokens=0)
    step(s)
    assert s.decode_ready_request_ids() == ["a", "b"] and s.num_lookahead_tokens == 3
    assert s.set_draft_tokens("b", np.array([30, 31], np.int64)) == 2
    with pytest.raises(KeyError):
        s.set_draft_tokens("zz", [1])
    with pytest.raises(ValueError, match="at most num_lookahead_tokens=3"):
        s.set_draft_tokens("a", [1, 2, 3, 4])
    assert s.get_request("a").draft_token_ids == [] and s.get_request("b").draft_token_ids == [30, 31]
    out = s.schedule()
    assert out.request_ids == ["a", "b"] and out.num_decode_reqs == 1
    assert out.num_draft_tokens.dtype == np.int32 and out.num_draft_tokens.tolist() == [0, 2]
    assert out.draft_token_ids.dtype == np.int64 and out.draft_token_ids.tolist() == [30, 31]
    assert out.input_ids.tolist() == [7, 7, 30, 31] and out.positions.tolist() == [5, 2, 3, 4]
    assert out.logits_indices.tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="update"):
        s.set_draft_tokens("a", [1])
    with pytest.raises(ValueError, match="draft"):  # b's first accepted token must be draft 30
        s.update(out, np.array([1, 2], np.int32), np.array([5, 31, 6], np.int64))
    s.update(out, np.array([1, 3], np.int32), np.array([5, 30, 31, 6], np.int64))
    assert s.get_output_token_ids("b") == [7, 30, 31, 6] and s.get_num_computed_tokens("b") == 5
    s.set_num_lookahead_tokens(0)
    assert s.num_lookahead_tokens == 0
    with pytest.raises(ValueError):
        s.set_draft_tokens("a", [1])


def test_steps_in_flight_through_the_bindings():
    """Pipeline micro-batches: two steps over disjoint requests before the first update (the C++ gtest
    scheduler_inflight_test covers the rules; this checks what Python sees)."""
    s = make(max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        s.set_max_steps_in_flight(0)
    s.set_max_steps_in_flight(2)
    assert s.max_steps_in_flight == 2 and s.num_steps_in_flight == 0
    s.add_request("a", list(range(8)), arrival_time=0.0)
    s.add_request("b", list(range(20, 28)), arrival_time=1.0)
    o1, o2 = s.schedule(), s.schedule()
    assert (o1.request_ids, o2.request_ids) == (["a"], ["b"])
    assert s.get_request("a").in_flight and s.num_steps_in_flight == 2
    with pytest.raises(RuntimeError, match="call update"):
        s.schedule()
    with pytest.raises(ValueError, match="oldest pending step"):
        s.update(o2, np.ones(1, np.int32), np.full(1, 7, np.int64))
    assert s.abort_pending_step(o2.step_id) == ["b"]  # the newer step failed; a's goes on
    s.update(o1, np.ones(1, np.int32), np.full(1, 7, np.int64))
    assert not s.get_request("a").in_flight and s.get_output_token_ids("a") == [7]
    assert s.num_free_blocks + 2 == s.num_blocks  # a holds its 8 computed tokens; b's blocks came back
