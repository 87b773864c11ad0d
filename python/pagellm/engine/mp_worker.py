"""The worker-process side of the "mp" executor (mp_executor.py): one process per rank of the tp x pp grid.

A rank pins itself to its slice of the CPUs, joins the rank grid (distributed/rank_groups.py, shared with
the "ray" executor: one gloo world, global rank = pp_rank * tp_size + tp_rank), builds a `Worker`, reports
("ready", num_kv_blocks) and then serves requests from the driver over its pipe: pickled (method, args,
kwargs, reply_with_result) in, ("ok", result) or ("error", exception, traceback text) out. A None message
ends it. With pipeline stages (pp > 1) a thread reads the pipe ahead into a queue: the driver writes step
k+1 while this rank still runs step k, and neither side may block on the other's full pipe (the driver
would wait to write while this rank waits to write step k's reply). Only the first rank of the last
pipeline stage (`output_rank`) returns step outputs (the other ranks' are identical copies, or nothing on
earlier stages, which the driver does not need).
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from pagellm.distributed.rank_groups import join_rank_groups, output_rank

STEP_TIMEOUT_ENV = "PAGELLM_MP_STEP_TIMEOUT_S"  # the longest one call may take before the driver gives up


@dataclass
class SchedulerOutputSnapshot:
    """A picklable copy of the C++ SchedulerOutput (what the model runner reads), sent to every rank."""

    step_id: int
    request_ids: list
    num_decode_reqs: int
    total_num_scheduled_tokens: int
    max_blocks_in_batch: int
    num_reqs: int
    arrays: dict[str, np.ndarray]
    # a hybrid KV cache's groups 1..: (slot mapping, block tables) of each ([] with one group)
    groups: list[tuple[np.ndarray, np.ndarray]]

    ARRAY_FIELDS = ("num_scheduled_tokens", "query_start_loc", "num_computed_tokens", "seq_lens", "input_ids",
                    "positions", "slot_mapping", "block_tables", "do_sample", "num_draft_tokens", "draft_token_ids",
                    "logits_indices", "cow_copies", "cow_copy_groups")

    @classmethod
    def of(cls, so) -> "SchedulerOutputSnapshot":
        groups = [(np.array(so.group_slot_mapping(g), copy=True), np.array(so.group_block_tables(g), copy=True))
                  for g in range(1, so.num_kv_cache_groups)]
        return cls(int(so.step_id), list(so.request_ids), int(so.num_decode_reqs), int(so.total_num_scheduled_tokens),
                   int(so.max_blocks_in_batch), int(so.num_reqs),
                   {name: np.array(getattr(so, name), copy=True) for name in cls.ARRAY_FIELDS}, groups)

    @property
    def num_kv_cache_groups(self) -> int:
        return 1 + len(self.groups)

    def group_slot_mapping(self, group: int) -> np.ndarray:
        return self.arrays["slot_mapping"] if group == 0 else self.groups[group - 1][0]

    def group_block_tables(self, group: int) -> np.ndarray:
        return self.arrays["block_tables"] if group == 0 else self.groups[group - 1][1]

    def __getattr__(self, name: str):
        arrays = self.__dict__.get("arrays")
        if arrays is not None and name in arrays:
            return arrays[name]
        raise AttributeError(name)

    def __len__(self) -> int:
        return self.num_reqs


def _call(worker, method, args: tuple, kwargs: dict) -> Any:
    fn = getattr(worker, method) if isinstance(method, str) else (lambda *a, **k: method(worker, *a, **k))
    return fn(*args, **kwargs)


def _error_reply(exc: BaseException) -> bytes:
    text = traceback.format_exc()
    try:
        reply = pickle.dumps(("error", exc, text))
        pickle.loads(reply)  # an exception whose __init__ takes other arguments pickles but does not load
        return reply
    except Exception:  # noqa: BLE001 - then its type name and text are enough
        return pickle.dumps(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), text))


def worker_main(rank: int, tp_size: int, port: int, cpus: list[int] | None, config, model_files, conn,
                pp_size: int = 1, shm_name: str | None = None) -> None:
    """Entry point of global rank `rank` of tp_size x pp_size (spawned). Never returns normally while the
    driver keeps the pipe open. `shm_name`: base name of the TP groups' shared-memory segments (None: gloo)."""
    if cpus:
        os.sched_setaffinity(0, cpus)  # this rank's CPUs: its kernels' pool sizes and pins itself to them
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        from pagellm.engine.worker import Worker  # noqa: PLC0415

        timeout = timedelta(seconds=float(os.environ.get(STEP_TIMEOUT_ENV, "300")))
        if tp_size * pp_size > 1:
            join_rank_groups(rank, tp_size, pp_size, f"tcp://127.0.0.1:{port}", timeout,
                             model_files.hf_config.num_hidden_layers, shm_name)
        worker = Worker(config, model_files, rank=rank)
        conn.send_bytes(pickle.dumps(("ok", worker.num_kv_blocks)))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send_bytes(_error_reply(e))
        return
    _serve(worker, rank == output_rank(tp_size, pp_size), conn, read_ahead=pp_size > 1)


def _read_ahead(conn, inbox: queue.SimpleQueue) -> None:
    """Moves the driver's messages into `inbox` as they arrive; None once the pipe closes."""
    while True:
        try:
            inbox.put(conn.recv_bytes())
        except (EOFError, OSError):
            inbox.put(None)
            return


def _serve(worker, returns_outputs: bool, conn, read_ahead: bool = False) -> None:
    inbox: queue.SimpleQueue | None = None
    if read_ahead:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_read_ahead, args=(conn, inbox), name="pagellm-pipe-reader", daemon=True).start()
    while True:
        if inbox is not None:
            message = inbox.get()
            if message is None:  # the driver is gone
                return
        else:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):  # the driver is gone
                return
        request = pickle.loads(message)
        if request is None:
            return
        method, args, kwargs, reply_with_result = request
        try:
            result = _call(worker, method, args, kwargs)
            reply = pickle.dumps(("ok", result if reply_with_result or returns_outputs else None))
        except BaseException as e:  # noqa: BLE001
            reply = _error_reply(e)
        conn.send_bytes(reply)
