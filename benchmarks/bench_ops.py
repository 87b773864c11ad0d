"""Benchmark of the CPU ops (torch.ops.pagellm) against their pure-torch references.

Prints one markdown row per op and size: op time, reference time, speedup, bytes moved and FLOPs per
call, achieved bandwidth as a fraction of this run's memory bandwidth (a 512 MiB tensor.copy_, read +
write counted) and, for attention, the FLOP rate as a fraction of a bf16 torch.matmul of the same
per-head shape (measured in the same run). Decode caches are rotated so that each call streams
>= 256 MiB from DRAM rather than re-reading the 105 MiB L3.

    python benchmarks/bench_ops.py            # full run, saves benchmarks/results/bench_ops_cpu.md
    python benchmarks/bench_ops.py --quick    # smoke run (small sizes, not saved)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from pagellm import ops
from pagellm.ops import reference as ref

BF16 = torch.bfloat16
MiB = 1 << 20


def timeit(fn, iters: int, warmup: int = 1) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(quick: bool) -> float:
    n = (64 if quick else 512) * MiB // 4
    src, dst = torch.randn(n), torch.empty(n)
    return 2 * src.nbytes / timeit(lambda: dst.copy_(src), 3 if quick else 5)


def matmul_rate(m: int, k: int, n: int, batch: int) -> float:
    a, b = torch.randn(batch, m, k, dtype=BF16), torch.randn(batch, k, n, dtype=BF16)
    return 2 * batch * m * k * n / timeit(lambda: torch.matmul(a, b), 5)


class Table:
    def __init__(self, bw: float) -> None:
        self.bw = bw
        self.rows: list[str] = []

    def add(self, op, size, t_op, t_ref, nbytes, flops, mm_rate=None, cached=False):
        frac_bw = nbytes / t_op / self.bw
        frac_mm = f"{flops / t_op / mm_rate:.0%}" if mm_rate else "-"
        ref_s = f"{t_ref * 1e3:.3f}" if t_ref else "-"
        ratio = f"{t_ref / t_op:.1f}x" if t_ref else "-"
        self.rows.append(
            f"| {op} | {size} | {t_op * 1e3:.3f} | {ref_s} | {ratio} | {nbytes / MiB:.1f} | {flops / 1e9:.2f} "
            f"| {nbytes / t_op / 1e9:.1f} | {frac_bw:.0%}{' (L3)' if cached else ''} | {flops / t_op / 1e9:.1f} | {frac_mm} |"
        )
        print(self.rows[-1], flush=True)

    HEADER = (
        "| op | size | op ms | ref ms | speedup | MiB/call | GFLOP/call | GB/s | % copy BW | GFLOP/s | % bf16 matmul |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )


def paged_setup(seq_lens, num_kv_heads, head_dim, block_size, min_bytes, seed=0):
    """Cache big enough for `rot` disjoint copies of the batch (rotated per call), with shuffled tables."""
    blocks_per = [(n + block_size - 1) // block_size for n in seq_lens]
    per_copy = sum(blocks_per)
    block_bytes = 2 * num_kv_heads * block_size * head_dim * 2
    rot = max(1, math.ceil(min_bytes / (per_copy * block_bytes)))
    g = torch.Generator().manual_seed(seed)
    num_blocks = per_copy * rot
    kc = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(BF16)
    vc = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(BF16)
    perm = torch.randperm(num_blocks, generator=g)
    tables = []
    for r in range(rot):
        t = torch.zeros(len(seq_lens), max(blocks_per), dtype=torch.int32)
        pos = r * per_copy
        for i, nb in enumerate(blocks_per):
            t[i, :nb] = perm[pos : pos + nb].to(torch.int32)
            pos += nb
        tables.append(t)
    return kc, vc, tables


def bench_decode(tab, batch, ctx, quick):
    H, KVH, D, BS = 32, 8, 128, 16
    kc, vc, tables = paged_setup([ctx] * batch, KVH, D, BS, 64 * MiB if quick else 256 * MiB)
    q = torch.randn(batch, H, D).to(BF16)
    out = torch.empty_like(q)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    it = iter(range(1 << 30))

    def run_op():
        ops.paged_attention_decode(out, q, kc, vc, tables[next(it) % len(tables)], lens, D**-0.5)

    t_op = timeit(run_op, 5 if quick else 20, warmup=2)
    t_ref = timeit(lambda: ref.paged_attention_decode(out, q, kc, vc, tables[0], lens, D**-0.5), 1 if quick else 2)
    nbytes = batch * ctx * KVH * D * 2 * 2 + 2 * q.nbytes
    flops = 4 * batch * H * ctx * D
    tab.add("paged_attention_decode", f"bs={batch} ctx={ctx} 32q/8kv D=128 bf16", t_op, t_ref, nbytes, flops)


def bench_prefill(tab, prompt, quick, mm_rate):
    H, KVH, D, BS = 32, 8, 128, 16
    kc, vc, tables = paged_setup([prompt], KVH, D, BS, 0)
    q = torch.randn(prompt, H, D).to(BF16)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, prompt], dtype=torch.int32)
    lens = torch.tensor([prompt], dtype=torch.int32)
    args = (q, kc, vc, tables[0], qsl, lens, D**-0.5)
    t_op = timeit(lambda: ops.paged_attention_prefill(out, *args), 2 if quick else 3)
    t_ref = timeit(lambda: ref.paged_attention_prefill(out, *args), 1 if quick else 2)
    nbytes = 2 * q.nbytes + prompt * KVH * D * 2 * 2
    flops = 4 * H * D * prompt * (prompt + 1) // 2  # causal
    tab.add("paged_attention_prefill", f"prompt={prompt} 32q/8kv D=128 bf16 causal", t_op, t_ref, nbytes, flops, mm_rate)


def bench_simple(tab, quick, big):
    hidden, iters = 4096, (3 if quick else 10)
    for T in (32, big):
        x = torch.randn(T, hidden).to(BF16)
        w = torch.randn(hidden).to(BF16)
        out = torch.empty_like(x)
        t_op = timeit(lambda: ops.rms_norm(out, x, w, 1e-6), iters)
        t_ref = timeit(lambda: ref.rms_norm(out, x, w, 1e-6), iters)
        tab.add("rms_norm", f"T={T} hidden={hidden} bf16", t_op, t_ref, 2 * x.nbytes + w.nbytes, 4 * x.numel(), cached=2 * x.nbytes < 100 * MiB)
        res = torch.randn(T, hidden).to(BF16)
        t_op = timeit(lambda: ops.fused_add_rms_norm(x, res, w, 1e-6), iters)
        t_ref = timeit(lambda: ref.fused_add_rms_norm(x, res, w, 1e-6), iters)
        tab.add("fused_add_rms_norm", f"T={T} hidden={hidden} bf16", t_op, t_ref, 4 * x.nbytes + w.nbytes, 5 * x.numel(), cached=4 * x.nbytes < 100 * MiB)

    H, KVH, D = 32, 8, 128
    for T in (32, big):
        qkv = torch.randn(T, (H + 2 * KVH) * D).to(BF16)
        q, k = qkv[:, : H * D], qkv[:, H * D : (H + KVH) * D]
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2).float() / D))
        freqs = torch.arange(8192).float()[:, None] * inv
        cache = torch.cat([freqs.cos(), freqs.sin()], -1)
        pos = torch.randint(0, 8192, (T,))
        t_op = timeit(lambda: ops.rotary_embedding(pos, q, k, D, cache, True), iters)
        t_ref = timeit(lambda: ref.rotary_embedding(pos, q, k, D, cache, True), iters)
        nbytes = 2 * T * (H + KVH) * D * 2 + T * D * 4
        tab.add("rotary_embedding", f"T={T} 32q/8kv D=128 neox bf16 (qkv slices)", t_op, t_ref, nbytes, 6 * T * (H + KVH) * D, cached=nbytes < 100 * MiB)

    inter = 11008
    for T in (32, big // 4):
        x = torch.randn(T, 2 * inter).to(BF16)
        out = torch.empty(T, inter, dtype=BF16)
        for name, fn, rfn in (
            ("silu_and_mul", lambda: ops.silu_and_mul(out, x), lambda: ref.silu_and_mul(out, x)),
            ("gelu_and_mul", lambda: ops.gelu_and_mul(out, x, "tanh"), lambda: ref.gelu_and_mul(out, x, "tanh")),
        ):
            t_op, t_ref = timeit(fn, iters), timeit(rfn, iters)
            tab.add(name, f"T={T} d={inter} bf16", t_op, t_ref, x.nbytes + out.nbytes, 8 * out.numel(), cached=x.nbytes + out.nbytes < 100 * MiB)

    T, KVH, BS = big, 8, 16
    nb = T // BS * 4
    kc, vc = torch.zeros(nb, KVH, BS, D, dtype=BF16), torch.zeros(nb, KVH, BS, D, dtype=BF16)
    key, value = torch.randn(T, KVH, D).to(BF16), torch.randn(T, KVH, D).to(BF16)
    slots = torch.randperm(nb * BS)[:T]
    t_op = timeit(lambda: ops.reshape_and_cache(kc, vc, key, value, slots), iters)
    t_ref = timeit(lambda: ref.reshape_and_cache(kc, vc, key, value, slots), iters)
    tab.add("reshape_and_cache", f"T={T} 8kv D=128 bf16 bs=16", t_op, t_ref, 2 * (key.nbytes + value.nbytes), 0, cached=True)
    pairs = min(256, nb // 2)
    mapping = torch.stack([torch.arange(0, pairs), torch.arange(nb - pairs, nb)], 1)
    t_op = timeit(lambda: ops.copy_blocks([kc], [vc], mapping), iters)
    t_ref = timeit(lambda: ref.copy_blocks([kc], [vc], mapping), iters)
    tab.add("copy_blocks", f"{pairs} blocks x 1 layer, 8kv bs=16 D=128 bf16", t_op, t_ref, 2 * 2 * pairs * kc[0].nbytes, 0, cached=True)


def _bench_linears(tab, name, op, shapes, quick, max_iters):
    """bf16 `op(out, x, w)` vs F.linear (the 'ref' column) per (m, k, n); weights are rotated over copies
    totalling >= 256 MiB so each call streams its weight from DRAM (as a decode step does)."""
    for m, k, n in shapes:
        w0 = torch.randn(n, k, dtype=BF16)
        copies = max(1, math.ceil((64 if quick else 256) * MiB / w0.nbytes))
        ws = [w0] + [w0.clone() for _ in range(copies - 1)]
        x = torch.randn(m, k, dtype=BF16)
        out = torch.empty(m, n, dtype=BF16)
        it = iter(range(1 << 30))

        def run_op():
            op(out, x, ws[next(it) % copies])

        def run_ref():
            torch.nn.functional.linear(x, ws[next(it) % copies])

        iters = 5 if quick else max(10, min(max_iters, int(2e9 / w0.nbytes)))
        t_op, t_ref = timeit(run_op, iters, warmup=2), timeit(run_ref, iters, warmup=2)
        tab.add(name, f"[{m},{k}]x[{n},{k}]^T bf16 (ref: F.linear bf16), {copies} weight copies", t_op, t_ref,
                w0.nbytes + x.nbytes + out.nbytes, 2 * m * n * k)
        del ws


def bench_linear_small_m(tab, quick):
    """Decode-shaped bf16 linears through linear_small_m."""
    shapes = [(1, 576, 1536), (1, 576, 49152), (8, 896, 4864), (1, 896, 151936)]
    _bench_linears(tab, "linear_small_m", ops.linear_small_m, shapes[:2] if quick else shapes, quick, 200)


def bench_linear_amx(tab, quick):
    """bf16 linears of 3-128 rows (decode batches; csrc/ops/linear/linear_choice.h routes them to linear_amx on an
    AMX CPU)."""
    if not ops.amx_available():
        print("linear_amx: skipped (no AMX-BF16 on this CPU or in this build)", flush=True)
        return
    shapes = [(8, 896, 9728), (32, 896, 9728), (64, 4864, 896), (128, 896, 1152), (32, 896, 151936),
              (128, 896, 151936)]
    _bench_linears(tab, "linear_amx", ops.linear_amx, shapes[:2] if quick else shapes, quick, 100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few iterations, no results file")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_ops_cpu.md"))
    args = p.parse_args()
    ok, why = ops.ops_available()
    if not ok:
        raise SystemExit(why)
    bw = copy_bandwidth(args.quick)
    prompt = 512 if args.quick else 2048
    mm = matmul_rate(prompt, 128, prompt, 8)
    head = [
        f"# bench_ops (CPU) {'--quick' if args.quick else ''}",
        "",
        f"- machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}",
        f"- copy bandwidth (tensor.copy_, read+write): {bw / 1e9:.1f} GB/s; load average at start "
        f"{os.getloadavg()[0]:.1f} (the machine is shared: other jobs skew every number, ratios less so)",
        f"- bf16 torch.matmul [8 x {prompt}x128 @ 128x{prompt}] (one prefill head's QK^T shape): {mm / 1e9:.1f} GFLOP/s",
        "- '(L3)' marks rows whose working set fits the 105 MiB L3, so '% copy BW' can exceed DRAM copy speed",
        "",
        Table.HEADER,
    ]
    print("\n".join(head), flush=True)
    tab = Table(bw)
    if args.quick:
        bench_decode(tab, 4, 512, True)
        bench_decode(tab, 1, 1024, True)
    else:
        bench_decode(tab, 32, 2048, False)
        bench_decode(tab, 1, 4096, False)
    bench_prefill(tab, prompt, args.quick, mm)
    bench_simple(tab, args.quick, 256 if args.quick else 8192)
    bench_linear_small_m(tab, args.quick)
    bench_linear_amx(tab, args.quick)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(head + tab.rows) + "\n")
        print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
