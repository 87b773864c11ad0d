"""Scheduler step overhead at steady-state decode: 256 running requests with 2k-token contexts.

Measures per step the wall time of schedule() + update() as seen from Python (including touching the
output arrays a runner needs) and the C++ time inside those calls (Scheduler.last_*_us).
"""
import argparse
import time

import numpy as np

from pagellm import _C


def stats(xs):
    a = np.asarray(xs)
    return a.min(), a.mean(), np.percentile(a, 50), np.percentile(a, 99)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    R, ctx, bs = args.num_reqs, args.context, args.block_size
    blocks_per_req = (ctx + args.steps + 16) // bs + 2
    s = _C.Scheduler(max_num_seqs=R, max_num_batched_tokens=8192, max_model_len=ctx + args.steps + 64,
                     num_blocks=R * blocks_per_req + 64, block_size=bs, enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    for i in range(R):
        s.add_request(f"req-{i}", rng.integers(0, 32000, ctx).tolist(), arrival_time=float(i))
    # Prefill everything (untimed) until every request decodes.
    while True:
        out = s.schedule()
        n = out.do_sample.astype(np.int32)
        s.update(out, n, rng.integers(0, 32000, int(n.sum())))
        if out.num_decode_reqs == R:
            break
    py_sched, py_upd, cpp_sched, cpp_upd, total = [], [], [], [], []
    ones = np.ones(R, np.int32)
    for _ in range(args.steps):
        toks = rng.integers(0, 32000, R)
        t0 = time.perf_counter()
        out = s.schedule()
        _ = (out.request_ids, out.input_ids, out.positions, out.slot_mapping, out.block_tables,
             out.query_start_loc, out.seq_lens, out.logits_indices, out.cow_copies)
        t1 = time.perf_counter()
        s.update(out, ones, toks)
        t2 = time.perf_counter()
        assert out.num_decode_reqs == R
        py_sched.append((t1 - t0) * 1e6)
        py_upd.append((t2 - t1) * 1e6)
        total.append((t2 - t0) * 1e6)
        cpp_sched.append(s.last_schedule_us)
        cpp_upd.append(s.last_update_us)
    print(f"{R} running requests, {ctx}-token contexts, block_size {bs}, {args.steps} decode steps")
    print(f"{'':34s}{'min':>9s}{'mean':>9s}{'p50':>9s}{'p99':>9s}  (us)")
    for name, xs in [("schedule() from Python (+arrays)", py_sched), ("update() from Python", py_upd),
                     ("schedule()+update() from Python", total), ("schedule() C++", cpp_sched),
                     ("update() C++", cpp_upd)]:
        lo, m, p50, p99 = stats(xs)
        print(f"{name:34s}{lo:9.1f}{m:9.1f}{p50:9.1f}{p99:9.1f}")


if __name__ == "__main__":
    main()
