"""How pagellm uses the CPU: the C++ kernels' thread pool and torch's own (OpenMP) intra-op threads.

On a machine where other processes are busy, spinning OpenMP workers that each own a fixed slice of a
kernel's range made batch-1 decode tens of times slower: the OS parks a spinning worker on a busy core
and every kernel waits a time slice for it. pagellm's CPU kernels therefore run on their own pool
(csrc/ops/common/thread_pool.h: chunks claimed dynamically, short spin then sleep, workers pinned to
the CPUs the process may use), and torch's remaining OpenMP ops get the same thread count and a short
spin.

Environment (read by `ThreadingConfig.from_env`, applied once per process by the CPU `Worker`):

    PAGELLM_NUM_THREADS   threads per kernel, the caller included: an integer in [1, allowed CPUs]
                          (allowed: `os.sched_getaffinity`); default all of them; more is clamped with a
                          warning; 0, negative or not an integer is a ValueError
    PAGELLM_BIND          "cores" (default: pin each pool worker to one allowed CPU) or "none"
    PAGELLM_THREAD_POOL   "0": the previous threading, for comparisons (kernels on at::parallel_for, torch's
                          OpenMP settings untouched); read when pagellm is imported
    PAGELLM_RETAIN_HEAP   "1" (default): glibc malloc keeps freed memory mapped (`retain_heap`); "0": its defaults

Why retain_heap: a 2048-token prefill step allocates and frees activations of a few MB each (a layer's qkv,
gate_up, ...). With glibc's defaults they come from fresh mmaps, or from heap memory trimmed back to the OS when they
are freed, so every step touches them again as new zeroed pages: ~55k minor faults (~2.5 us of CPU each here, the
kernel's page clearing on top, and a process-wide lock a second thread's faults wait on) per 64 x (128 -> 128)
offline run of the default model. Raising the mmap threshold to its largest value (32 MiB) and the trim threshold
to 1 GiB keeps that memory in the heap, reused step after step (~1.5k faults); the cost is that the process keeps
its peak heap (the activations of one step) instead of returning it between steps.

`set_openmp_defaults` (called by `import pagellm`) sets GOMP_SPINCOUNT / OMP_WAIT_POLICY defaults; OpenMP
reads them when libgomp loads, i.e. only when pagellm is imported before torch (a variable the user set
always wins). Imported after torch, torch's OpenMP keeps its default spinning; the kernels' pool does not
depend on it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from pagellm.logger import init_logger

logger = init_logger(__name__)

BIND_MODES = ("cores", "none")
# libgomp's spin before sleeping, in iterations of a pause loop (its default, 300000, is milliseconds of
# a busy core after every torch op; a few thousand covers the gaps inside one op sequence).
OPENMP_SPIN_COUNT = "10000"
# glibc mallopt parameters (malloc.h) and the values retain_heap sets: the mmap threshold at its maximum on 64-bit
# (HEAP_MAX_SIZE / 2; larger blocks, a weight or the KV cache, still get their own mmap), the heap trimmed only past
# 1 GiB of free memory at its top.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
RETAIN_MMAP_THRESHOLD = 32 << 20
RETAIN_TRIM_THRESHOLD = 1 << 30


def thread_pool_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """False when PAGELLM_THREAD_POOL=0 (the previous threading, for comparisons)."""
    return environ.get("PAGELLM_THREAD_POOL", "1") != "0"


def allowed_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, which taskset / cgroup cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def set_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Short OpenMP spin for torch's own ops, unless the user chose one. Effective only before torch loads."""
    if not thread_pool_enabled(environ) or "OMP_WAIT_POLICY" in environ:
        return
    environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


@dataclass(frozen=True)
class ThreadingConfig:
    """num_threads: threads per CPU kernel, caller included (None: every allowed CPU); bind: BIND_MODES;
    retain_heap: glibc malloc keeps freed memory for reuse instead of returning it to the OS (see the module doc)."""

    num_threads: int | None = None
    bind: str = "cores"
    retain_heap: bool = True

    def __post_init__(self) -> None:
        n = self.num_threads
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_threads must be an integer in [1, {allowed_cpu_count()}] (the CPUs this "
                             f"process may use) or None for all of them; got {n!r}")
        if self.bind not in BIND_MODES:
            raise ValueError(f"bind must be one of {BIND_MODES}; got {self.bind!r}")
        if not isinstance(self.retain_heap, bool):
            raise TypeError(f"retain_heap must be a bool; got {self.retain_heap!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ThreadingConfig:
        """PAGELLM_NUM_THREADS / PAGELLM_BIND / PAGELLM_RETAIN_HEAP; ValueError naming the variable and the allowed
        values."""
        raw_threads = environ.get("PAGELLM_NUM_THREADS", "").strip()
        num_threads = None
        if raw_threads:
            try:
                num_threads = int(raw_threads)
            except ValueError:
                num_threads = raw_threads  # refused below with the allowed range
        bind = environ.get("PAGELLM_BIND", "cores").strip().lower()
        retain = environ.get("PAGELLM_RETAIN_HEAP", "1").strip()
        if retain not in ("0", "1"):
            raise ValueError(f"PAGELLM_RETAIN_HEAP must be '1' (keep freed memory) or '0' (glibc's defaults); "
                             f"got {retain!r}")
        try:
            return cls(num_threads=num_threads, bind=bind, retain_heap=retain == "1")
        except ValueError as e:
            raise ValueError(f"PAGELLM_NUM_THREADS={raw_threads!r} / PAGELLM_BIND={bind!r}: {e}") from None

    def resolve_num_threads(self, allowed: int) -> int:
        """The thread count to use on `allowed` CPUs: all by default, clamped (with a warning) above."""
        if self.num_threads is None:
            return allowed
        if self.num_threads > allowed:
            logger.warning("num_threads=%d is more than the %d CPUs this process may use; using %d",
                           self.num_threads, allowed, allowed)
            return allowed
        return self.num_threads


def retain_heap() -> bool:
    """Sets glibc malloc's mmap threshold to RETAIN_MMAP_THRESHOLD and its trim threshold to RETAIN_TRIM_THRESHOLD
    (mallopt), so the blocks a step frees are reused by the next one rather than mapped afresh. False where the C
    library has no mallopt (not glibc) or refused a value."""
    import ctypes  # noqa: PLC0415

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, RETAIN_MMAP_THRESHOLD) == 1
    return mallopt(M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD) == 1 and ok


def apply_threading(config: ThreadingConfig) -> dict:
    """Sizes the kernels' pool and torch's intra-op threads from `config` and applies retain_heap; returns what was
    applied.

    With PAGELLM_THREAD_POOL=0 the threading does not change (torch's defaults and at::parallel_for stay)."""
    import torch  # noqa: PLC0415  (this module is imported by pagellm/__init__ before torch)

    from pagellm import _C  # noqa: PLC0415

    retained = retain_heap() if config.retain_heap else False
    if not thread_pool_enabled():
        return {"enabled": False, "num_threads": torch.get_num_threads(), "retain_heap": retained}
    num_threads = config.resolve_num_threads(allowed_cpu_count())
    _C.configure_thread_pool(num_threads, bind=config.bind == "cores")
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    return {**_C.thread_pool_info(), "retain_heap": retained}


def _num_threads_arg(s: str) -> int:
    try:
        ThreadingConfig(num_threads=int(s))
        return int(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}" if "num_threads" in str(e) else
                                         f"{s!r} is not an integer") from None


def add_threading_args(p: argparse.ArgumentParser) -> None:
    """--num-threads / --thread-bind for `pagellm generate` and `serve` (see export_threading_args)."""
    p.add_argument("--num-threads", type=_num_threads_arg, default=None,
                   help=f"threads per CPU kernel (PAGELLM_NUM_THREADS; default: all {allowed_cpu_count()} CPUs this "
                        "process may use; more is clamped)")
    p.add_argument("--thread-bind", choices=BIND_MODES, default=None,
                   help="pin the kernels' pool workers to CPUs (PAGELLM_BIND; default: cores)")


def export_threading_args(args: argparse.Namespace, environ: MutableMapping[str, str] = os.environ) -> None:
    """Hands --num-threads / --thread-bind to the Worker as PAGELLM_NUM_THREADS / PAGELLM_BIND (process settings,
    read when the engine starts); unset options leave the environment as it is."""
    if getattr(args, "num_threads", None) is not None:
        environ["PAGELLM_NUM_THREADS"] = str(args.num_threads)
    if getattr(args, "thread_bind", None) is not None:
        environ["PAGELLM_BIND"] = args.thread_bind
