"""Data-parallel serving: `pagellm serve MODEL --data-parallel-size N [--dp-routing least_loaded|prefix]`.

N replica processes, each a plain `pagellm serve` of the same model on an internal 127.0.0.1 port, pinned to
its own contiguous slice of the allowed CPUs (the CPU kernels' thread pool is per process), behind one front
server (entrypoints/openai/dp_app.py) on --host / --port that routes each request (dp_router.py).

With --tensor-parallel-size M (and/or --pipeline-parallel-size) every replica is its own M-rank group: its mp
executor splits the replica's CPU slice among its ranks and joins them on a free port of its own (its own
gloo world and shared-memory segments), so replicas never share a process group. N x M ranks need N x M CPUs.

    replicas = start_replicas(args, num_replicas=2)     # ValueError before anything starts for a bad set-up;
    ...                                                 # RuntimeError naming the replica and its stderr tail
    stop_replicas(replicas)                             # when one fails to start within startup_timeout_s

A replica's process: `python -m pagellm.entrypoints.dp_replica` with the replica's serve arguments pickled on
stdin; its stderr goes to a log file whose tail the start-up error quotes.
"""

from __future__ import annotations

import argparse
import copy
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagellm.distributed.validation import cpu_slices  # contiguous, near-equal CPU slices

DEFAULT_STARTUP_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 30.0


def check_data_parallel(dp_size: int, args: argparse.Namespace, allowed_cpus: int) -> None:
    """ValueError when `dp_size` replicas cannot be served here (raised before any process starts)."""
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {dp_size!r}")
    if dp_size > allowed_cpus:
        raise ValueError(f"data_parallel_size ({dp_size}) is more than the {allowed_cpus} CPUs this process may "
                         f"use: each replica needs at least one")
    world = replica_world_size(args)
    if dp_size * world > allowed_cpus:  # every replica's slice must hold one CPU per rank of its own group
        tp, pp = getattr(args, "tensor_parallel_size", None) or 1, getattr(args, "pipeline_parallel_size", None) or 1
        raise ValueError(f"data_parallel_size x tensor_parallel_size x pipeline_parallel_size ({dp_size} x {tp} x "
                         f"{pp} = {dp_size * world} ranks) is more than the {allowed_cpus} CPUs this process may "
                         f"use: each rank needs at least one; lower one of them")
    device = getattr(args, "device", None)
    if dp_size > 1 and device is not None and not str(device).startswith("cpu"):
        raise ValueError(f"data_parallel_size={dp_size}: only device='cpu' is supported for now, got {device!r}")


def replica_world_size(args: argparse.Namespace) -> int:
    """Ranks (processes with their own CPUs) per replica: tensor_parallel_size x pipeline_parallel_size."""
    return (getattr(args, "tensor_parallel_size", None) or 1) * (getattr(args, "pipeline_parallel_size", None) or 1)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """One replica server process. `dead_reason()`: None while it runs, else why it cannot serve."""

    def __init__(self, index: int, port: int, cpus: list[int], proc: subprocess.Popen, log_path: Path) -> None:
        self.index, self.port, self.cpus, self.proc, self.log_path = index, port, cpus, proc, log_path
        self.url = f"http://127.0.0.1:{port}"

    def dead_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        return f"replica {self.index} (pid {self.proc.pid}) exited with code {code}"

    def stderr_tail(self, num_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


def replica_args(args: argparse.Namespace, port: int) -> argparse.Namespace:
    """A replica's `pagellm serve` arguments: the front's, on 127.0.0.1:`port`, as one replica (so it serves
    itself). The API key stays: the front passes the client's header on, and checks it first."""
    r = copy.copy(args)
    r.host, r.port, r.data_parallel_size = "127.0.0.1", port, 1
    return r


def start_replicas(args: argparse.Namespace, num_replicas: int, *,
                   startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> list[Replica]:
    """Starts the replicas and waits (at most startup_timeout_s) until each answers /health with 200.
    ValueError for a bad set-up (nothing started); RuntimeError naming the replica and its stderr tail when one
    exits or is not up in time (all of them are stopped then)."""
    allowed = sorted(os.sched_getaffinity(0))
    check_data_parallel(num_replicas, args, len(allowed))
    log_dir = Path(tempfile.mkdtemp(prefix="pagellm-dp-"))
    replicas: list[Replica] = []
    try:
        for i, cpus in enumerate(cpu_slices(allowed, num_replicas)):
            replicas.append(_spawn(i, cpus, replica_args(args, free_port()), log_dir))
        _wait_ready(replicas, startup_timeout_s)
    except BaseException:
        stop_replicas(replicas, timeout_s=5.0)
        raise
    return replicas


def _spawn(index: int, cpus: list[int], args: argparse.Namespace, log_dir: Path) -> Replica:
    env = dict(os.environ)
    if getattr(args, "num_threads", None) is None:
        if replica_world_size(args) == 1:  # the kernels' pool: one thread per CPU of the slice
            env["PAGELLM_NUM_THREADS"] = str(len(cpus))
        else:  # its ranks split the slice (mp executor) and each sizes its pool to its own CPUs
            env.pop("PAGELLM_NUM_THREADS", None)
    log_path = log_dir / f"replica{index}.log"
    with open(log_path, "wb") as log:
        # the affinity is set before exec, so torch and the kernels' pool start inside the slice
        proc = subprocess.Popen([sys.executable, "-m", "pagellm.entrypoints.dp_replica"], stdin=subprocess.PIPE,
                                stdout=log, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    proc.stdin.write(pickle.dumps(args))
    proc.stdin.close()
    return Replica(index, args.port, cpus, proc, log_path)


def _wait_ready(replicas: list[Replica], timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.dead_reason() is not None:
                raise RuntimeError(f"{r.dead_reason()} while starting; its output ends with:\n{r.stderr_tail()}")
            try:
                if httpx.get(r.url + "/health", timeout=2).status_code == 200:
                    pending.remove(r)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            r = pending[0]
            raise RuntimeError(f"replica {r.index} (pid {r.proc.pid}) was not serving after {timeout_s:.0f} s; "
                               f"its output ends with:\n{r.stderr_tail()}")
        if pending:
            time.sleep(0.2)


def stop_replicas(replicas: list[Replica], timeout_s: float = _STOP_TIMEOUT_S) -> None:
    """SIGTERM to each live replica (it drains: the front has nothing in flight by now), SIGKILL after timeout_s."""
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def run_data_parallel(args: argparse.Namespace) -> int:
    """`pagellm serve --data-parallel-size N`: the replicas, then the front until SIGTERM / SIGINT."""
    import uvicorn

    from pagellm.entrypoints.openai.dp_app import build_dp_app
    from pagellm.entrypoints.openai.dp_router import make_router
    from pagellm.entrypoints.uvicorn_server import GracefulServer
    from pagellm.logger import init_logger

    logger = init_logger("pagellm.serve")
    api_key = args.api_key or os.environ.get("PAGELLM_API_KEY") or None
    args.api_key = api_key
    router = make_router(args.dp_routing, args.data_parallel_size)  # a bad policy is refused before any start
    replicas = start_replicas(args, args.data_parallel_size)
    try:
        app = build_dp_app(replicas, router, api_key, max_request_bytes=args.max_request_bytes,
                           metrics_require_auth=args.metrics_require_auth)
        logger.info("serving %d replicas (%s routing; CPUs %s) on http://%s:%d/v1", len(replicas), args.dp_routing,
                    [r.cpus for r in replicas], args.host, args.port)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5, timeout_graceful_shutdown=5)
        GracefulServer(config, app.state.drain, shutdown_timeout_s=args.shutdown_timeout).run()
    finally:
        stop_replicas(replicas)
    return 0
