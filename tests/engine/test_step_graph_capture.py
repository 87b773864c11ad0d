"""StepRecorder / StepGraph / StepGraphCache on plain torch functions: what is replayed, what is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.step_graph import CaptureError, StepGraphCache, StepGraphMismatch, StepRecorder, build_step_graph

pytest.importorskip("pagellm._C", reason="StepGraph lives in the compiled extension")

W = torch.randn(7, 5)
TABLE = torch.randn(11, 3)


def mixed_ops(ins: list[torch.Tensor]) -> torch.Tensor:
    """Views, lists of tensors (Tensor[]), optional-tensor lists (Tensor?[]), in-place ops, Python scalars."""
    x, idx = ins
    y = torch.nn.functional.linear(x, W)                     # [n, 7]
    a, b = y.split([3, 4], dim=-1)
    z = torch.cat([a, TABLE[idx]], dim=-1)                   # Tensor[] with a constant-derived element
    z.mul_(0.5).add_(1)
    picked = z[torch.arange(z.shape[0]), idx % 6]            # aten.index: Tensor?[]
    return torch.tanh(picked)[:, None] * b.sum(-1, keepdim=True) - 2


def record(fn, inputs, constants):
    ids = {id(t) for t in constants}
    recorder = StepRecorder(inputs, lambda t: id(t) in ids)
    with recorder:
        out = fn(inputs)
    return recorder, out


@pytest.mark.parametrize("n", [1, 4, 9])
def test_replay_equals_eager_on_new_inputs(n):
    gen = torch.Generator().manual_seed(n)
    inputs = [torch.randn(n, 5, generator=gen), torch.randint(0, 11, (n,), generator=gen)]
    recorder, out = record(mixed_ops, inputs, [W, TABLE])
    assert torch.equal(out, mixed_ops(inputs))
    graph = build_step_graph(recorder.recording, [recorder.slot(out)])
    assert graph.num_nodes == len(recorder.recording.calls) > 5
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        new = [torch.randn(n, 5, generator=g), torch.randint(0, 11, (n,), generator=g)]
        assert torch.equal(graph.run(new)[0], mixed_ops(new))


def out_buffers(ins: list[torch.Tensor]) -> torch.Tensor:
    """Kernel-style out= calls into torch.empty buffers (which a replay may keep between replays); the result
    is a view of one of them, so the caller shares its storage."""
    x = ins[0]
    h = torch.empty((x.shape[0], 8), dtype=x.dtype)
    torch.mul(x, 2.0, out=h)
    g = torch.empty((x.shape[0], 8), dtype=x.dtype)
    torch.add(h, 1.0, out=g)
    torch.mul(g, h, out=g)
    return g.view(-1)[: 3 * x.shape[0]].view(x.shape[0], 3)


@pytest.mark.parametrize("held_by_caller", [False, True])
def test_kept_empty_buffers_are_never_shared_with_a_held_result(held_by_caller):
    """Replays reuse their small torch.empty intermediates; a result the caller still holds (here a view of
    an empty made by the replay, sharing its storage) must not be overwritten by the next replay."""
    x = torch.randn(4, 8)
    rec, out = record(out_buffers, [x], [])
    assert [c.name for c in rec.recording.calls].count("aten::empty") == 2
    graph = build_step_graph(rec.recording, [rec.slot(out)])
    held = []
    for seed in range(4):
        new = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        got = graph.run([new])[0]
        assert torch.equal(got, out_buffers([new]))
        if held_by_caller:
            held.append((got, got.clone()))
    for got, copy in held:  # earlier results untouched by later replays
        assert torch.equal(got, copy)


def test_weights_updated_in_place_are_seen_by_the_replay():
    w = torch.randn(4, 4)
    fn = lambda ins: ins[0] @ w  # noqa: E731
    x = torch.randn(2, 4)
    recorder, out = record(fn, [x], [w])
    graph = build_step_graph(recorder.recording, [recorder.slot(out)])
    w.mul_(3)  # what an RL weight update does: copy into the same tensor
    assert torch.equal(graph.run([x])[0], x @ w)


def test_reading_tensor_data_into_python_is_refused():
    def reads_item(ins):
        n = int(ins[0].sum())  # a data-dependent Python value: a replay would bake it in
        return ins[0] * n

    with pytest.raises(CaptureError, match="Python value"):
        record(reads_item, [torch.ones(3)], [])


def test_a_tensor_of_unknown_origin_is_refused():
    def from_numpy(ins):
        return ins[0] + torch.from_numpy(np.ones(3, dtype=np.float32))  # created outside the dispatcher

    with pytest.raises(CaptureError, match="unknown origin"):
        record(from_numpy, [torch.ones(3)], [])


def test_cache_captures_on_the_second_sighting_and_replays_afterwards():
    calls = [0]

    def fn(ins):
        calls[0] += 1  # Python side effects run only when the step runs eagerly
        return ins[0] * 2 + 1

    cache = StepGraphCache([], max_graphs=1, capture_after=2)
    x = torch.randn(3)
    for i in range(4):
        assert torch.equal(cache.run("k", [x + i], fn), (x + i) * 2 + 1)
    assert (cache.num_captures, cache.num_replays, calls[0]) == (1, 2, 2)
    assert cache.num_warmup_runs == 2  # the eager first sighting and the capture: one-time costs
    # one graph at most: a new key evicts the old one
    y = torch.randn(5)
    for _ in range(2):
        cache.run("other", [y], fn)
    assert cache.num_graphs == 1 and cache.num_captures == 2
    cache.run("k", [x], fn)  # evicted: runs eagerly again
    assert calls[0] == 5


def test_cache_runs_a_refused_key_eagerly_for_good():
    def fn(ins):
        return ins[0] * float(ins[0].max())

    cache = StepGraphCache([], capture_after=1)
    x = torch.randn(3)
    for _ in range(3):
        assert torch.equal(cache.run("k", [x], fn), x * float(x.max()))
    assert cache.num_graphs == 0 and cache.num_replays == 0


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError):
        StepGraphCache([], max_graphs=0)
    recorder, out = record(lambda ins: ins[0] + 1, [torch.ones(2)], [])
    graph = build_step_graph(recorder.recording, [recorder.slot(out)])
    with pytest.raises(ValueError, match="takes 1 inputs"):
        graph.run([])


def test_check_mode_catches_a_data_read_the_recorder_cannot_see():
    def reads_tolist(ins):
        # .tolist() reads tensor data without a dispatcher call: the recording bakes this step's value in
        return ins[0] * ins[0].tolist()[0]

    cache = StepGraphCache([], capture_after=1, check=True)
    assert torch.equal(cache.run("k", [torch.full((2,), 3.0)], reads_tolist), torch.full((2,), 9.0))
    assert torch.equal(cache.run("k", [torch.full((2,), 3.0)], reads_tolist), torch.full((2,), 9.0))  # same data: fine
    with pytest.raises(StepGraphMismatch, match="differs from the eager forward"):
        cache.run("k", [torch.full((2,), 2.0)], reads_tolist)
