"""Sleep / wake of one worker's memory: the KV cache (level 1) and the weights too (level 2).

Tensors keep their identity (the runner, the attention backend and captured step graphs hold them); only
their storages shrink to zero bytes and grow back, so nothing that references them has to be rebuilt.

    level 1: KV-cache storages freed; on wake reallocated as zeros (their contents are gone: the caller
             resets the prefix cache).
    level 2: also every parameter and buffer storage of the model, after saving its bytes: on CPU to a
             file in a temporary directory (host memory is what sleeping should return, so a host copy
             would free nothing), on an accelerator to pinned host memory. Wake reads them back.

Memory returned is measured: process RSS on CPU (after `malloc_trim`), allocator reserved bytes on CUDA.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from pagellm.model_loader.weight_arena import advise_huge_pages, arena_mode

SLEEP_LEVELS = (1, 2)


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _return_freed_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:  # glibc keeps freed heap pages in its arenas; give them back so RSS really drops
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def device_memory_bytes(device: torch.device) -> int:
    """What the process holds on `device`: allocator-reserved bytes on CUDA, RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_reserved(device))
    return rss_bytes()


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct non-empty, resizable storage once (views and tied parameters share one). Storages torch
    cannot resize (a buffer made from numpy, say) stay allocated: they are small, and never the KV cache."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.resizable() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_buffer(storage: torch.UntypedStorage) -> memoryview:
    """A CPU storage's bytes for file I/O. Not via numpy: exporting to numpy makes a storage unresizable."""
    return memoryview((ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())).cast("B")


@dataclass
class SleepingState:
    """What a sleeping worker must restore: storages with their byte sizes, and where saved weights are."""

    level: int
    kv_storages: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    weight_storages: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)
    weight_file: Path | None = None
    host_copies: list[torch.Tensor] = field(default_factory=list)
    tmpdir: tempfile.TemporaryDirectory | None = None
    freed_bytes: int = 0  # measured drop in device_memory_bytes (>= 0)


def _free(storages: list[torch.UntypedStorage]) -> list[tuple[torch.UntypedStorage, int]]:
    sized = [(s, s.nbytes()) for s in storages]
    for s, _ in sized:
        s.resize_(0)
    return sized


def _save_weights(state: SleepingState, storages: list[torch.UntypedStorage], device: torch.device) -> None:
    if device.type == "cpu":
        state.tmpdir = tempfile.TemporaryDirectory(prefix="pagellm-sleep-")
        state.weight_file = Path(state.tmpdir.name) / "weights.bin"
        with open(state.weight_file, "wb") as fh:
            for s in storages:
                fh.write(_host_buffer(s))
    else:
        pin = torch.cuda.is_available()
        state.host_copies = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin).copy_(_as_bytes(s))
                             for s in storages]


def put_to_sleep(level: int, kv_tensors: Iterable[torch.Tensor], weight_tensors: Iterable[torch.Tensor],
                 device: torch.device) -> SleepingState:
    """Free the KV-cache storages (and at level 2 the weights', saved first); returns what wake needs."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
    before = device_memory_bytes(device)
    state = SleepingState(level)
    weights = unique_storages(weight_tensors) if level == 2 else []
    if weights:
        _save_weights(state, weights, device)  # before anything is freed: a failed write changes nothing
    state.kv_storages = _free(unique_storages(kv_tensors))
    state.weight_storages = _free(weights)
    _return_freed_memory(device)
    state.freed_bytes = max(0, before - device_memory_bytes(device))
    return state


def wake_from_sleep(state: SleepingState) -> None:
    """Reallocate the KV cache as zeros and (level 2) read the weights back; the temporary file is removed."""
    for s, nbytes in state.kv_storages:
        s.resize_(nbytes)
        _as_bytes(s).zero_()
    if state.weight_file is not None:
        huge = arena_mode() == "huge"
        with open(state.weight_file, "rb") as fh:
            for s, nbytes in state.weight_storages:
                s.resize_(nbytes)
                if huge:  # a fresh, untouched allocation: huge pages again, as weight_arena gave them
                    advise_huge_pages(s.data_ptr(), nbytes)
                if fh.readinto(_host_buffer(s)) != nbytes:
                    raise OSError(f"{state.weight_file}: truncated while restoring the weights")
    for (s, nbytes), host in zip(state.weight_storages, state.host_copies):
        s.resize_(nbytes)
        _as_bytes(s).copy_(host, non_blocking=False)
    if state.tmpdir is not None:
        state.tmpdir.cleanup()
    state.kv_storages, state.weight_storages, state.host_copies = [], [], []
