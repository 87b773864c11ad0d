"""Reading checkpoint tensors so that a tensor-parallel rank touches only its slices.

`iter_mmap_weights_with_file` yields every tensor of the model's safetensors files as a zero-copy view of
a private (copy-on-write) memory map of the file: nothing is read until a loader copies from it, and a
rank's loader copies only its slice (sharding / parallel_linear narrow the view first), so each rank
reads its rows or columns of a weight, plus the small replicated tensors (norms) whole.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Iterator

import torch

# safetensors dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES["F8_E4M3"] = torch.float8_e4m3fn


def mmap_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, zero-copy tensor view) for every tensor of one .safetensors file (the map lives as long as a view)."""
    with open(path, "rb") as fh:
        header_len = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(header_len))
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # writable for frombuffer, never written back
    data_start = 8 + header_len
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']} that this reader does not map")
        begin, end = meta["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + begin) if count else \
            torch.empty(0, dtype=dtype)
        yield name, flat.view(meta["shape"])


def iter_mmap_weights_with_file(weight_files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """As model_loader.files.iter_weights_with_file, with memory-mapped views instead of copies."""
    for f in weight_files:
        for name, tensor in mmap_safetensors(f):
            yield f, name, tensor
