"""The actor side of the "ray" executor (ray_executor.py): one `RayWorkerActor` per rank of the tp x pp grid.

An actor starts light (no torch model yet) so the driver can first check where it landed and with which
versions (`node_info`), then ask rank 0's node for a free port (`free_port`), and only then build the
rank's `Worker` inside the rank grid (`init_worker`: the same gloo world, stage groups and pipeline stage as
the mp executor's ranks, distributed/rank_groups.py). After that it serves `execute` calls in the order
the driver sent them (an actor runs one call at a time): a `Worker` method name or a callable
`fn(worker, *args, **kwargs)`. Only the output rank (tp rank 0 of the last stage) returns step outputs (the
other ranks' are identical copies, or nothing on earlier stages).
"""

from __future__ import annotations

import os
import platform
import socket
from datetime import timedelta
from typing import Any

import torch

import pagellm


def local_versions() -> dict[str, str]:
    """What must match between the driver and every node: a rank running other code computes other shards."""
    return {"pagellm": pagellm.__version__, "torch": torch.__version__, "python": platform.python_version()}


def _interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` (gloo binds to it), None when it cannot be told."""
    try:
        import psutil  # noqa: PLC0415 - a Ray dependency, not pagellm's
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


class RayWorkerActor:
    """One rank. Wrapped with `ray.remote` by the executor (so importing this module needs no Ray)."""

    def __init__(self) -> None:
        self.worker = None
        self.rank = -1
        self.returns_outputs = False

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs and with which versions."""
        import ray  # noqa: PLC0415

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid(), "versions": local_versions()}

    def free_port(self) -> int:
        """A TCP port free on this node now (rank 0's node hosts the gloo rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_worker(self, rank: int, tp_size: int, pp_size: int, master_ip: str, master_port: int, config,
                    model_files, timeout_s: float) -> int:
        """Join the rank grid (tp_size x pp_size > 1; distributed/rank_groups.py, as the mp executor's ranks),
        build this rank's Worker; returns its KV block count."""
        from pagellm.distributed.rank_groups import join_rank_groups, output_rank  # noqa: PLC0415
        from pagellm.engine.worker import Worker  # noqa: PLC0415

        self.rank = rank
        self.returns_outputs = rank == output_rank(tp_size, pp_size)
        if tp_size * pp_size > 1:
            my_ip = self.node_info()["ip"]
            iface = "lo" if my_ip.startswith("127.") else _interface_of(my_ip)
            if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = iface  # the interface Ray reaches this node on
            join_rank_groups(rank, tp_size, pp_size, f"tcp://{master_ip}:{master_port}", timedelta(seconds=timeout_s),
                             model_files.hf_config.num_hidden_layers)
        self.worker = Worker(config, model_files, rank=rank)
        return self.worker.num_kv_blocks

    def execute(self, method, call: tuple[tuple, dict], reply_with_result: bool) -> Any:
        """Run `method(*args, **kwargs)` on this rank's Worker, `call` = (args, kwargs) (the driver puts it in
        the object store once; Ray hands every rank the same object). The output rank (tp rank 0 of the last
        stage), or every rank when reply_with_result, returns the result."""
        args, kwargs = call
        fn = getattr(self.worker, method) if isinstance(method, str) else (
            lambda *a, **k: method(self.worker, *a, **k))
        result = fn(*args, **kwargs)
        return result if reply_with_result or self.returns_outputs else None
