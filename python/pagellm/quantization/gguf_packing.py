"""The row-packed GGUF layout of `gguf_linear` on the CPU (csrc/ops/quant/gguf_cpu_packed.h), in pure torch.

Every full group of 16 weight rows is rearranged block by block so that one int32 lane of a VNNI dot is one
weight row. A block is a list of fields (`_FIELDS`: offset and length in the file's block, unit 2 for an fp16,
4 for a quad of quant or scale bytes); block b of a group sits at byte b * 16 * block_bytes of the group, its
fields one after another, each as [unit u][row r][unit bytes] (e.g. Q4_1: the 16 rows' fp16 d, their 16 m, then
quant quad c of row r at c * 64 + r * 4; Q4_K: d, dmin, the 12 scale bytes as 3 quads, 32 quant quads; Q6_K: d,
the 16 int8 scales as 4 quads, 32 ql quads, 16 qh quads). The last N % 16 rows keep the file's layout. The
tensor keeps its shape [N, row_bytes]; the op is told by `qtype | PACKED_FLAG`. The permutation is exact (bytes
move, none change), so unpacking gives the file back.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from pagellm.ops.reference import GGUF_BLOCK_BYTES, GGUF_BLOCK_ELEMS, GGUF_QTYPES

PACK_ROWS = 16
PACKED_FLAG = 0x100
# (offset, bytes, unit) of each field of a block, in packed order, per type (gguf_cpu_packed.h: packed_fields)
_FIELDS = {
    8: ((0, 2, 2), (2, 32, 4)),                             # Q8_0: d, qs
    2: ((0, 2, 2), (2, 16, 4)),                             # Q4_0: d, qs
    3: ((0, 2, 2), (2, 2, 2), (4, 16, 4)),                  # Q4_1: d, m, qs
    12: ((0, 2, 2), (2, 2, 2), (4, 12, 4), (16, 128, 4)),   # Q4_K: d, dmin, scales, qs
    14: ((208, 2, 2), (192, 16, 4), (0, 128, 4), (128, 64, 4)),  # Q6_K: d, scales, ql, qh
}
PACKABLE_QTYPES = tuple(sorted(_FIELDS))


def _block_source_bytes(qtype: int) -> list[tuple[int, int]]:
    """For each byte of one packed block of 16 rows: (row, byte offset within that row's block)."""
    return [(r, offset + unit * u + t) for offset, size, unit in _FIELDS[qtype] for u in range(size // unit)
            for r in range(PACK_ROWS) for t in range(unit)]


@lru_cache(maxsize=32)
def _group_gather_index(qtype: int, row_bytes: int) -> torch.Tensor:
    """int64 [16 * row_bytes]: packed group byte p = original group byte index[p] (rows of row_bytes)."""
    block_bytes = GGUF_BLOCK_BYTES[qtype]
    per_block = torch.tensor([r * row_bytes + o for r, o in _block_source_bytes(qtype)], dtype=torch.int64)
    blocks = torch.arange(row_bytes // block_bytes, dtype=torch.int64) * block_bytes
    return (blocks[:, None] + per_block[None, :]).reshape(-1)


def _check(qweight: torch.Tensor, qtype: int) -> None:
    if qtype not in PACKABLE_QTYPES:
        type_names = {t: name for name, t in GGUF_QTYPES.items()}
        names = ", ".join(f"{t} ({type_names[t]})" for t in PACKABLE_QTYPES)
        raise ValueError(f"qtype must be one of {names}, got {qtype}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] % GGUF_BLOCK_BYTES[qtype]:
        raise ValueError(f"qweight must be uint8 [N, K / {GGUF_BLOCK_ELEMS[qtype]} * {GGUF_BLOCK_BYTES[qtype]}], got "
                         f"{qweight.dtype} {list(qweight.shape)}")


def pack_rows(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """qweight uint8 [N, row_bytes] in the file's layout -> a new tensor of the same shape in the packed layout
    (pass `qtype | PACKED_FLAG` to gguf_linear)."""
    _check(qweight, qtype)
    n, row_bytes = qweight.shape
    full = n // PACK_ROWS * PACK_ROWS
    out = qweight.clone()
    if full:
        groups = qweight[:full].reshape(full // PACK_ROWS, PACK_ROWS * row_bytes)
        out[:full] = groups[:, _group_gather_index(qtype, row_bytes)].reshape(full, row_bytes)
    return out


def unpack_positions(qtype: int, row_bytes: int, device=None) -> torch.Tensor:
    """int64 [16, row_bytes]: where byte o of row j of a group (file layout) sits in its packed group."""
    index = _group_gather_index(qtype, row_bytes)
    where = torch.empty_like(index)
    where[index] = torch.arange(index.numel())
    return where.view(PACK_ROWS, row_bytes).to(device)


def unpack_rows(packed: torch.Tensor, qtype: int, row_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """The file's layout again: all rows ([N, row_bytes]), or just `row_ids` ([len(row_ids), row_bytes], e.g.
    an embedding lookup's rows). `positions`: `unpack_positions(qtype, row_bytes)`, if the caller keeps it
    (tensor ops only then: safe inside a captured step)."""
    _check(packed, qtype)
    n, row_bytes = packed.shape
    ids = torch.arange(n, device=packed.device) if row_ids is None else row_ids.reshape(-1).to(torch.int64)
    if positions is None:
        positions = unpack_positions(qtype, row_bytes, packed.device)
    full = n // PACK_ROWS * PACK_ROWS
    in_group = ids < full
    packed_pos = ((ids - ids % PACK_ROWS) * row_bytes)[:, None] + positions[ids % PACK_ROWS]
    plain_pos = ids[:, None] * row_bytes + torch.arange(row_bytes, device=packed.device)[None, :]
    return packed.reshape(-1)[torch.where(in_group[:, None], packed_pos, plain_pos)]


def _cpu_has_avx512_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    except OSError:
        pass
    return False


def packing_pays_off(device: torch.device, params_dtype: torch.dtype) -> bool:
    """Whether gguf_linear's packed kernel would run: a CPU weight, half-precision activations, AVX-512 VNNI
    present and not narrowed away by PAGELLM_GGUF_CPU_ISA. Elsewhere a packed weight still works (rows are
    unpacked tile by tile) but is slower than the file's layout, so it is not packed."""
    isa = os.environ.get("PAGELLM_GGUF_CPU_ISA")
    return (torch.device(device).type == "cpu" and params_dtype in (torch.bfloat16, torch.float16)
            and isa in (None, "", "avx512_vnni") and _cpu_has_avx512_vnni())
