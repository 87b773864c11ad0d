"""The shared-memory all-reduce (pagellm._C.ShmAllReduce via distributed.shm_comm): threads stand in for
ranks (the op releases the GIL while it waits) and are checked against a plain sum in rank order with fp32
accumulation, bit for bit on every rank; chunking; a missing peer's timeout and a dead peer process both
name the rank; no segment name is left in /dev/shm. The TP engine with shm (the default) is covered by
test_tensor_parallel.py; here its ranks are checked to use it, and PAGELLM_TP_ALLREDUCE=gloo to not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pytest
import torch

pytest.importorskip("pagellm._C", reason="the shared-memory all-reduce is compiled into pagellm._C (run `make install`)")

from pagellm.distributed.shm_comm import (  # noqa: E402
    ALLREDUCE_BACKEND_ENV, SHM_TIMEOUT_ENV, ShmCommunicator, allreduce_backend, shm_timeout_s, unlink_segments,
)


def _name(tag: str) -> str:
    return f"/pagellm-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _leftovers() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("pagellm-test-") and f"-{os.getpid()}-" in f]


def _run_ranks(name: str, inputs: list[torch.Tensor], slot_bytes: int, repeats: int = 1,
               op=lambda comm, x: comm.all_reduce(x.clone())) -> list[torch.Tensor]:
    """Each rank (a thread with its own communicator) runs `op` (default: all-reduce a copy) on its input
    `repeats` times; the last results."""
    world = len(inputs)
    outputs: list = [None] * world
    errors: list = [None] * world

    def rank_main(rank: int) -> None:
        try:
            comm = ShmCommunicator(name, rank, world, timeout_s=20.0, slot_bytes=slot_bytes)
            for _ in range(repeats):
                outputs[rank] = op(comm, inputs[rank])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for e in errors:
        if e is not None:
            raise e
    return outputs


def _rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    acc = inputs[0].float().clone()
    for x in inputs[1:]:
        acc += x.float()
    return acc.to(inputs[0].dtype)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim,slot_bytes", [((3, 321), -1, 1 << 20), ((5, 1001), -1, 256), ((4, 7), 0, 64),
                                                  ((2, 3, 5), 1, 64)])
def test_all_gather_concatenates_in_rank_order_on_every_rank(world, dtype, shape, dim, slot_bytes):
    g = torch.Generator().manual_seed(world)
    inputs = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    name = _name("gather")

    def gather_then_reduce(comm, x):  # the LM head's all-gather shares its rounds with the all-reduces
        out = comm.all_gather(x, dim)
        comm.all_reduce(torch.ones(3))
        return out

    outputs = _run_ranks(name, inputs, slot_bytes, repeats=3, op=gather_then_reduce)
    expected = torch.cat(inputs, dim=dim)
    for out in outputs:
        assert out.dtype == dtype and torch.equal(out, expected)
    assert _leftovers() == []


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,slot_bytes", [((1, 2048), 1 << 20), ((3, 333), 1 << 20), ((7,), 64),
                                              ((5, 1001), 4096)])  # the last two: many chunks, a short last one
def test_sum_matches_rank_order_fp32_sum_bit_for_bit_on_every_rank(world, dtype, shape, slot_bytes):
    g = torch.Generator().manual_seed(world * 100 + len(shape))
    inputs = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
    outputs = _run_ranks(_name("sum"), inputs, slot_bytes, repeats=2)
    expected = _rank_order_sum(inputs)
    for rank, out in enumerate(outputs):
        assert out.shape == expected.shape and out.dtype == dtype
        assert torch.equal(out, expected), f"rank {rank}"
    torch.testing.assert_close(outputs[0].float(), torch.stack(inputs).float().sum(0),
                               rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-2 if dtype != torch.float32 else 1e-6)
    assert _leftovers() == []


def test_non_contiguous_input_returns_the_sum():
    inputs = [torch.randn(6, 4).t(), torch.randn(6, 4).t()]
    outputs = _run_ranks(_name("strided"), inputs, 1 << 20)
    for out in outputs:
        assert torch.equal(out, inputs[0] + inputs[1])


def test_missing_peer_times_out_naming_the_rank_and_leaves_no_name():
    name = _name("timeout")
    comm = ShmCommunicator(name, 0, 2, timeout_s=0.3)
    with pytest.raises(RuntimeError, match="for rank 1"):
        comm.all_reduce(torch.ones(8))
    with pytest.raises(RuntimeError, match="unusable"):  # broken from then on
        comm.all_reduce(torch.ones(8))
    del comm
    assert _leftovers() == []


_PEER_THAT_DIES = """
import sys, os
from pagellm import _C
c = _C.ShmAllReduce(sys.argv[1], 1, 2, timeout_s=20.0)
os._exit(0)
"""


def test_dead_peer_process_fails_the_wait_naming_rank_and_pid():
    name = _name("dead")
    comm = ShmCommunicator(name, 0, 2, timeout_s=30.0)
    peer = subprocess.Popen([sys.executable, "-c", _PEER_THAT_DIES, name])
    peer.wait(60)
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {peer.pid}\) exited"):
        comm.all_reduce(torch.ones(8))
    assert _leftovers() == []  # unlinked once both had attached


def test_bad_arguments_and_settings_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="rank must be in"):
        ShmCommunicator(_name("bad"), 2, 2)
    with pytest.raises(ValueError, match="slot_bytes"):
        ShmCommunicator(_name("bad"), 0, 2, slot_bytes=100)
    comm = ShmCommunicator(_name("single"), 0, 1)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        comm._comm.all_reduce(torch.ones(4, dtype=torch.int64))
    assert not comm.supports(torch.ones(4, dtype=torch.int64)) and comm.supports(torch.ones(4, dtype=torch.bfloat16))
    monkeypatch.setenv(ALLREDUCE_BACKEND_ENV, "nccl")
    with pytest.raises(ValueError, match="shm"):
        allreduce_backend()
    monkeypatch.setenv(ALLREDUCE_BACKEND_ENV, "GLOO")
    assert allreduce_backend() == "gloo"
    monkeypatch.delenv(ALLREDUCE_BACKEND_ENV)
    assert allreduce_backend() == "shm"
    monkeypatch.setenv(SHM_TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match="> 0"):
        shm_timeout_s()
    unlink_segments(_name("never-created"), 2)  # a no-op, no error
    assert _leftovers() == []
