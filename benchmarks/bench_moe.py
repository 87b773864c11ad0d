"""fused_moe (torch.ops.pagellm.fused_moe) against the per-expert loop it replaces (`ops.moe_reference.fused_moe`:
nonzero per expert, two matmuls, index_add), on Mixtral- and Qwen-MoE-like shapes scaled for a CPU.

    python benchmarks/bench_moe.py                       # E=8,k=2,H=1024,I=2048 and E=64,k=6,H=1024,I=256
    python benchmarks/bench_moe.py --tokens 1 8 --dtypes bf16 --rounds 5
    python benchmarks/bench_moe.py --smoke               # tiny sizes, a few seconds: checks the script runs

Rounds are interleaved (op, loop, op, loop, ...) and medians reported, with the ratio loop / op. For T = 1 the
decode figure MBU = bytes of the chosen experts' weights (w13 + w2 of the k experts) / time, over the copy
bandwidth (read + write) measured in the same run (`common.copy_bandwidth_gbs`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import common as C

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (name, E, k, H, I)
SHAPES = [("mixtral-like", 8, 2, 1024, 2048), ("qwen-moe-like", 64, 6, 1024, 256)]
SMOKE_SHAPES = [("tiny", 4, 2, 64, 48)]


def make_inputs(T: int, E: int, k: int, H: int, I: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=1)
    return hidden, w13, w2, weights, ids


def time_call(fn, iters: int) -> float:
    """Seconds per call, the mean of `iters` back-to-back calls."""
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def chosen_expert_bytes(ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Bytes of the weights a call must read: w13 + w2 of every expert some token chose."""
    n = int(torch.unique(ids).numel())
    return n * (w13[0].numel() + w2[0].numel()) * w13.element_size()


def bench_case(T, shape, dtype, rounds: int, iters: int) -> dict:
    from pagellm.ops import moe_reference

    name, E, k, H, I = shape
    args = make_inputs(T, E, k, H, I, dtype)
    op = lambda: torch.ops.pagellm.fused_moe(*args, "silu")  # noqa: E731
    loop = lambda: moe_reference.fused_moe(*args, "silu")  # noqa: E731
    err = (op().float() - loop().float()).abs().max().item()  # also warms both up
    op_s, loop_s = [], []
    for _ in range(rounds):
        op_s.append(time_call(op, iters))
        loop_s.append(time_call(loop, iters))
    op_t, loop_t = statistics.median(op_s), statistics.median(loop_s)
    return {"shape": name, "E": E, "k": k, "H": H, "I": I, "T": T, "dtype": str(dtype).replace("torch.", ""),
            "op_ms": op_t * 1e3, "loop_ms": loop_t * 1e3, "speedup": loop_t / op_t, "max_abs_diff": err,
            "weight_bytes": chosen_expert_bytes(args[4], args[1], args[2]), "op_s": op_s, "loop_s": loop_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10, help="calls per timed round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds: checks the script runs")
    args = ap.parse_args()
    import pagellm.ops  # noqa: F401  (registers torch.ops.pagellm)

    threads = C.setup_threads(args.threads)
    shapes, rounds, iters = (SMOKE_SHAPES, 2, 2) if args.smoke else (SHAPES, args.rounds, args.iters)
    bw = C.copy_bandwidth_gbs(64 << 20 if args.smoke else 512 << 20)
    print(f"threads {threads}, copy bandwidth (read + write) {bw['median_gbs']:.1f} GB/s median", flush=True)
    results = []
    for shape in shapes:
        for dtype_name in args.dtypes:
            for T in args.tokens:
                r = bench_case(T, shape, DTYPES[dtype_name], rounds, iters)
                r["mbu"] = r["weight_bytes"] / (r["op_ms"] / 1e3) / (bw["median_gbs"] * 1e9) if T == 1 else None
                results.append(r)
                print(f"{r['shape']} {r['dtype']} T={T}: op {r['op_ms']:.3f} ms, loop {r['loop_ms']:.3f} ms, "
                      f"{r['speedup']:.2f}x" + (f", MBU {r['mbu']:.2f}" if r["mbu"] is not None else ""), flush=True)
    headers = ["shape (E, k, H, I)", "dtype", "T", "fused_moe ms", "per-expert loop ms", "loop / op", "MBU (T=1)"]
    rows = [[f"{r['shape']} ({r['E']}, {r['k']}, {r['H']}, {r['I']})", r["dtype"], r["T"], r["op_ms"], r["loop_ms"],
             r["speedup"], "" if r["mbu"] is None else f"{r['mbu']:.2f}"] for r in results]
    md = (f"fused_moe vs the per-expert loop, {threads} threads, medians of {rounds} interleaved rounds; copy "
          f"bandwidth {bw['median_gbs']:.1f} GB/s\n\n" + C.md_table(headers, rows))
    print(md)
    if not args.smoke:
        C.save_results("moe", md, {"env": C.env_info(), "copy_bandwidth": bw, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
