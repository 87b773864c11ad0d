"""One contiguous, huge-page-backed allocation for a CPU model's weights (issue 22: batch-1 decode streams
every weight byte once per token, so it runs at the rate memory can be read).

With 4 KiB pages a decode step that streams 270 MB of weights crosses 66k pages: each a TLB miss (in a VM a
two-dimensional page walk) and a fresh start for the hardware prefetchers, which stop at page boundaries.
`pack_weights` copies every parameter and buffer into one allocation, in module order (the order a forward
reads them), whose 2 MiB-aligned interior is `madvise(MADV_HUGEPAGE)`d before its first touch, so the kernel
backs it with transparent huge pages where it can (THP "madvise" or "always"; nothing happens under "never").
Tensors keep their identity (`t.data` is swapped): modules, step graphs and optimizers that hold them see the
new placement. The arena is one ordinary torch storage, so sleep (engine/sleep.py) frees and restores it whole
(advising the restored bytes again before reading them back).

`PAGELLM_WEIGHT_ARENA=0` leaves weights where loading put them; `=nohuge` packs without the madvise (A/B).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

import torch
from torch import nn

WEIGHT_ARENA_ENV = "PAGELLM_WEIGHT_ARENA"
HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line


def arena_mode(environ=os.environ) -> str:
    """"huge" (default), "nohuge" or "off", from PAGELLM_WEIGHT_ARENA ("1" / "nohuge" / "0"); ValueError otherwise."""
    value = environ.get(WEIGHT_ARENA_ENV, "1").strip().lower()
    modes = {"1": "huge", "": "huge", "huge": "huge", "nohuge": "nohuge", "0": "off", "off": "off"}
    if value not in modes:
        raise ValueError(f"{WEIGHT_ARENA_ENV}={value!r}: expected 1 (huge pages, default), nohuge or 0 (off)")
    return modes[value]


def _packable(model: nn.Module) -> list[torch.Tensor]:
    """Each parameter and buffer once (tied ones share an object), in module order, that sits alone in its
    own CPU storage: a view of another tensor's storage is left where it is (moving it would split the two)."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous() or t.storage_offset() != 0:
            continue
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            continue
        out.append(t)
    storages: dict[int, int] = {}
    for t in out:
        ptr = t.untyped_storage().data_ptr()
        storages[ptr] = storages.get(ptr, 0) + 1
    return [t for t in out if storages[t.untyped_storage().data_ptr()] == 1]


def advise_huge_pages(ptr: int, nbytes: int) -> int:
    """madvise(MADV_HUGEPAGE) on the 2 MiB-aligned part of [ptr, ptr + nbytes); the bytes advised (0 where the
    platform has no THP)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not sys.platform.startswith("linux"):
        return 0
    start = -(-ptr // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (ptr + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) != 0:
        return 0  # an old kernel or THP compiled out: the arena still works with small pages
    return end - start


def pack_weights(model: nn.Module, huge_pages: bool = True) -> int:
    """Move `model`'s CPU parameters and buffers into one new allocation in module order (huge pages advised
    first when `huge_pages`); returns the bytes moved. Values are unchanged. A tensor is copied and its old
    storage released one at a time, so the peak is the arena plus one tensor."""
    tensors = _packable(model)
    if not tensors:
        return 0
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    slack = HUGE_PAGE_BYTES if huge_pages else 0
    raw = torch.empty(total + slack, dtype=torch.uint8)  # untouched: its pages fault in at the copies below
    base = 0
    if huge_pages:
        base = (-raw.data_ptr()) % HUGE_PAGE_BYTES
        advise_huge_pages(raw.data_ptr() + base, total)
    arena = raw[base:base + total]
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            nbytes = t.numel() * t.element_size()
            view = arena[off:off + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view
    return total
