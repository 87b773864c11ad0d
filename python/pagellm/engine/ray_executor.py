"""The "ray" executor: tensor_parallel_size x pipeline_parallel_size ranks as Ray actors, placed by a
placement group (bundle i holds global rank i = pp_rank * tp + tp_rank), on one machine or across a Ray
cluster (`ray start --head` / `ray start --address=<head>:6379`).

    driver (engine, scheduler, block manager; ray.init)
       │ each call: (args, kwargs) put in the object store once (the step's SchedulerOutputSnapshot),
       │ the same reference sent to every actor
       ▼
    RayWorkerActor rank 0 … tp*pp-1 (ray_worker.py: a Worker each in the rank grid of the mp executor,
                                     distributed/rank_groups.py: one gloo world whose rendezvous is a free
                                     port on rank 0's node, activations sent stage to stage; the output of
                                     tp rank 0 of the last stage is the step's)

Pipeline micro-batches (pipeline_parallel_size > 1, pipeline_microbatching): `submit_model` sends a step to
every actor and returns its object refs at once; an actor runs the calls of one caller in the order sent,
so stage 0 starts step k+1 while the last stage still runs step k, and `collect_model` waits for the refs
of one step (a collective_rpc in between waits for its own refs only: each call's replies are its own).

Start-up, every step bounded: the address is probed first (PAGELLM_RAY_CONNECT_TIMEOUT_S, default 10 s; a
ValueError names it), the placement group must be placed within PAGELLM_RAY_PLACEMENT_TIMEOUT_S (60 s),
every actor reports its node and its pagellm / torch / python versions (a mismatch with the driver's is a
ValueError naming the node), then the Workers are built. Calls wait at most PAGELLM_RAY_STEP_TIMEOUT_S
(300 s). A dead actor (ray.exceptions.RayActorError) fails the call with `WorkerDiedError` naming its rank
and node; the executor is then broken (later calls raise at once) and its actors are killed, so the
engine's step recovery fails the step's requests and /health reports it; the steps still in flight fail
with the same error when collected.
"""

from __future__ import annotations

import os
import socket
import time
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

from pagellm.config import EngineConfig
from pagellm.distributed.rank_groups import output_rank
from pagellm.distributed.validation import check_pipeline_parallel, check_tensor_parallel
from pagellm.engine.executor import ExecutorBase, check_rpc_method, register_executor
from pagellm.engine.model_runner import ModelRunnerOutput
from pagellm.engine.mp_executor import WorkerDiedError, per_rank_config
from pagellm.engine.mp_worker import SchedulerOutputSnapshot
from pagellm.engine.ray_worker import RayWorkerActor, local_versions
from pagellm.logger import init_logger
from pagellm.threading_config import ThreadingConfig

logger = init_logger(__name__)

CONNECT_TIMEOUT_ENV = "PAGELLM_RAY_CONNECT_TIMEOUT_S"
PLACEMENT_TIMEOUT_ENV = "PAGELLM_RAY_PLACEMENT_TIMEOUT_S"
STEP_TIMEOUT_ENV = "PAGELLM_RAY_STEP_TIMEOUT_S"


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return value


def _host_port(address: str) -> tuple[str, int]:
    """'host:port' or 'ray://host[:port]' (Ray Client, port 10001 by default) -> (host, port)."""
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep:
        if not address.startswith("ray://"):
            raise ValueError(f"Ray address {address!r} must be 'host:port', 'ray://host[:port]', 'auto' or 'local'")
        host, port = rest, "10001"
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ValueError(f"Ray address {address!r}: port {port!r} is not a number") from None


def _ask_gcs(address: str, timeout_s: float) -> None:
    """Raise unless a Ray GCS answers at `address` within `timeout_s` (a port that accepts connections may
    belong to anything: a proxy, another server). The question runs in a daemon thread so a client that
    keeps retrying cannot hold the caller past the deadline."""
    import threading  # noqa: PLC0415

    from ray._raylet import GcsClient  # noqa: PLC0415 - what `ray health-check` uses

    outcome: list = []

    def ask() -> None:
        try:
            GcsClient(address=address).internal_kv_get(b"pagellm-probe", b"pagellm", timeout=timeout_s)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            outcome.append(e)

    thread = threading.Thread(target=ask, name="pagellm-ray-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"no answer from a Ray GCS within {timeout_s:g} s")
    if outcome[0] is not None:
        raise ConnectionError(f"not a Ray GCS ({type(outcome[0]).__name__}: {outcome[0]})")


def connect_ray(address: str | None, timeout_s: float) -> None:
    """Connect this process to Ray: `address` (or RAY_ADDRESS) when given, else the Ray this process already
    joined, else a new local instance. ValueError naming the address when it does not answer within
    `timeout_s` (probed before Ray is asked: Ray's own retries take minutes)."""
    import ray  # noqa: PLC0415

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address not in (None, "auto", "local"):
        host, port = _host_port(address)
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            if not address.startswith("ray://"):  # Ray Client speaks its own protocol: the TCP answer must do
                _ask_gcs(f"{host}:{port}", timeout_s)
        except OSError as e:  # ConnectionError and TimeoutError included
            raise ValueError(f"Ray address {address!r} does not answer ({type(e).__name__}: {e}; waited at most "
                             f"{timeout_s:g} s, {CONNECT_TIMEOUT_ENV}); start the head with `ray start --head` "
                             f"or fix ray_address / RAY_ADDRESS") from None
    if ray.is_initialized():
        return  # e.g. the caller's ray.init(): its cluster is the one to use
    try:
        ray.init(address=address, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        raise ValueError(f"could not connect to Ray at {address or 'a new local instance'!r}: {e}") from None


def check_node_versions(driver: dict[str, str], node_infos: list[dict[str, Any]]) -> None:
    """ValueError naming the first rank's node whose pagellm / torch / python differs from the driver's."""
    for rank, info in enumerate(node_infos):
        diffs = [f"{pkg} {info['versions'].get(pkg)} (driver: {want})" for pkg, want in driver.items()
                 if info["versions"].get(pkg) != want]
        if diffs:
            raise ValueError(f"Ray node {info['ip']} (host {info['hostname']}, node id {info['node_id'][:12]}), "
                             f"where rank {rank} was placed, runs {', '.join(diffs)}: install the same pagellm, "
                             f"torch and python on every node of the Ray cluster")


@dataclass
class _RayCall:
    """A call sent to every actor: one object ref per rank, in rank order."""

    what: str
    refs: list


def _release(actors: list, pg) -> None:
    """Kill every actor and remove the placement group (idempotent; tolerant of a Ray already shut down)."""
    import ray  # noqa: PLC0415
    from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


@register_executor("ray")
class RayExecutor(ExecutorBase):
    """tensor_parallel_size x pipeline_parallel_size ranks as Ray actors, one placement-group bundle each
    (bundle i: global rank i); the output of tp rank 0 of the last stage is the step's."""

    def __init__(self, config: EngineConfig, model_files) -> None:
        super().__init__(config, model_files)
        import ray  # noqa: PLC0415

        pc, mc = config.parallel_config, config.model_config
        self.tp_size = pc.tensor_parallel_size
        self.pp_size = getattr(pc, "pipeline_parallel_size", 1)
        self.world_size = self.tp_size * self.pp_size
        self.output_rank = output_rank(self.tp_size, self.pp_size)
        check_pipeline_parallel(self.pp_size, self.tp_size, model_files.hf_config, device=mc.device,
                                speculative_config=config.speculative_config)
        check_tensor_parallel(self.tp_size, model_files.hf_config, device=mc.device)
        microbatching = self.pp_size > 1 and getattr(pc, "pipeline_microbatching", True)
        self._max_concurrent_batches = self.pp_size if microbatching else 1
        self.step_timeout_s = _env_seconds(STEP_TIMEOUT_ENV, 300.0)
        placement_timeout_s = _env_seconds(PLACEMENT_TIMEOUT_ENV, 60.0)
        connect_ray(pc.ray_address, _env_seconds(CONNECT_TIMEOUT_ENV, 10.0))
        self._broken: WorkerDiedError | None = None
        self.actors: list = []
        self.node_infos: list[dict[str, Any]] = []
        self.cpus_per_rank = ThreadingConfig.from_env().num_threads or 1
        self.placement_group = self._place(pc.ray_placement_strategy, placement_timeout_s)
        self._finalizer = weakref.finalize(self, _release, self.actors, self.placement_group)
        try:
            self._start_actors(ray, placement_timeout_s)
            self._num_kv_blocks = min(self._init_workers(config, model_files))
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d ranks (tp %d x pp %d) on nodes %s, %d KV blocks each", self.world_size,
                    self.tp_size, self.pp_size, [i["ip"] for i in self.node_infos], self._num_kv_blocks)

    # ---- start-up ---------------------------------------------------------------------------------------
    def _place(self, strategy: str, timeout_s: float):
        import ray  # noqa: PLC0415
        from ray.util.placement_group import placement_group, remove_placement_group  # noqa: PLC0415

        bundles = [{"CPU": self.cpus_per_rank} for _ in range(self.world_size)]
        pg = placement_group(bundles, strategy=strategy)
        if not pg.wait(timeout_seconds=timeout_s):
            remove_placement_group(pg)
            raise ValueError(f"Ray could not place {self.world_size} bundles of {{'CPU': {self.cpus_per_rank}}} "
                             f"(strategy {strategy}) within {timeout_s:g} s ({PLACEMENT_TIMEOUT_ENV}); the cluster "
                             f"has {ray.available_resources().get('CPU', 0):g} CPUs free. Add nodes or lower "
                             f"tensor_parallel_size / pipeline_parallel_size / PAGELLM_NUM_THREADS")
        return pg

    def _start_actors(self, ray, timeout_s: float) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        env = {k: v for k, v in os.environ.items() if k.startswith("PAGELLM_")}  # threads, timeouts, binding
        actor_cls = ray.remote(RayWorkerActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                        placement_group_bundle_index=rank)
            options = {"num_cpus": self.cpus_per_rank, "scheduling_strategy": strategy, "max_restarts": 0}
            if env:
                options["runtime_env"] = {"env_vars": env}
            self.actors.append(actor_cls.options(**options).remote())
        self.node_infos = self._gather([a.node_info.remote() for a in self.actors], timeout_s, "start-up")
        check_node_versions(local_versions(), self.node_infos)

    def _init_workers(self, config: EngineConfig, model_files) -> list[int]:
        import ray  # noqa: PLC0415

        # ranks sharing a node share its memory: each sizes its KV cache from its share of the budget
        ranks_per_node = max(Counter(i["node_id"] for i in self.node_infos).values())
        rank_config = per_rank_config(config, ranks_per_node)
        files = ray.put(replace(model_files, tokenizer=None))  # the ranks never tokenize
        master_ip = self.node_infos[0]["ip"]
        port = self._gather([self.actors[0].free_port.remote()], self.step_timeout_s, "start-up")[0]
        refs = [a.init_worker.remote(rank, self.tp_size, self.pp_size, master_ip, port, rank_config, files,
                                     self.step_timeout_s)
                for rank, a in enumerate(self.actors)]
        return self._gather(refs, 2 * self.step_timeout_s, "start-up")

    # ---- the executor interface -------------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def max_concurrent_batches(self) -> int:
        """pipeline_parallel_size with micro-batching (one step per stage in flight), else 1."""
        return self._max_concurrent_batches

    @property
    def broken_error(self) -> WorkerDiedError | None:
        """Why the executor cannot run calls any more (an actor died or stopped answering); None while healthy."""
        return self._broken

    def execute_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> ModelRunnerOutput:
        return self.collect_model(self.submit_model(sched_out, prompt_logprob_rows, **kwargs))

    def submit_model(self, sched_out, prompt_logprob_rows: list[int] | None = None, **kwargs: Any) -> _RayCall:
        """Send the step to every actor and return at once (the snapshot is taken now)."""
        snapshot = sched_out if isinstance(sched_out, SchedulerOutputSnapshot) else SchedulerOutputSnapshot.of(sched_out)
        return self._send_all("execute_model", (snapshot, prompt_logprob_rows), kwargs, reply_with_result=False)

    def collect_model(self, handle: _RayCall) -> ModelRunnerOutput:
        return self._wait(handle)[self.output_rank]

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        check_rpc_method(method)
        return self._wait(self._send_all(method, tuple(args), dict(kwargs or {}), reply_with_result=True))

    def _send_all(self, method, args: tuple, kwargs: dict, reply_with_result: bool) -> _RayCall:
        import ray  # noqa: PLC0415

        if self._broken is not None:
            raise self._broken
        call = ray.put((args, kwargs))  # once; every actor reads the same object
        refs = [a.execute.remote(method, call, reply_with_result) for a in self.actors]
        return _RayCall(f"call {getattr(method, '__name__', method)!r}", refs)

    def _wait(self, call: _RayCall) -> list[Any]:
        """`call`'s replies in rank order; a call sent before the executor broke fails with its error."""
        if self._broken is not None:
            raise self._broken
        return self._gather(call.refs, self.step_timeout_s, call.what)

    def _gather(self, refs: list, timeout_s: float, what: str) -> list[Any]:
        """Every actor's reply in rank order; a rank's exception is raised after all replied (bounded),
        WorkerDiedError when an actor dies or the deadline passes (then the executor is broken)."""
        import ray  # noqa: PLC0415
        from ray.exceptions import RayActorError, WorkerCrashedError  # noqa: PLC0415

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results, errors = {}, {}
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._mark_broken(min(pending.values()), f"during {what}: no reply within {timeout_s:g} s")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, 1.0))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except (RayActorError, WorkerCrashedError) as e:
                    raise self._mark_broken(rank, f"during {what} ({type(e).__name__})") from None
                except Exception as e:  # noqa: BLE001 - the rank's own error (RayTaskError is also its type)
                    errors[rank] = e
                    deadline = min(deadline, time.monotonic() + 30.0)  # the others may wait in a collective
        if errors:
            raise errors[min(errors)]
        return [results[r] for r in range(len(refs))]

    def _mark_broken(self, rank: int, when: str) -> WorkerDiedError:
        where = ""
        if rank < len(self.node_infos):
            info = self.node_infos[rank]
            where = f" (Ray actor pid {info['pid']} on node {info['ip']}, host {info['hostname']})"
        hint = ("; an actor that cannot start on a node is often a Ray / Python version mismatch there"
                if "start-up" in when and not self.node_infos else "")
        stage = f" (pipeline stage {rank // self.tp_size})" if self.pp_size > 1 else ""
        self._broken = WorkerDiedError(f"worker rank {rank}{stage}{where} died or stopped answering "
                                       f"{when}; the ray executor is unusable (its other actors were killed){hint}")
        logger.error("%s", self._broken)
        self.shutdown()
        return self._broken

    def shutdown(self) -> None:
        """Kill every actor and remove the placement group (idempotent). Ray itself stays connected."""
        self._finalizer()
