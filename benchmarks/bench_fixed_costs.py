#!/usr/bin/env python
"""The fixed per-step costs of a batch-1 decode step, part by part (issue 22, session 13).

    python benchmarks/bench_fixed_costs.py                 # default model, bf16
    python benchmarks/bench_fixed_costs.py --pagellm-src /tmp/base/python --tag before   # another checkout

Four probes, each the minimum (and median) over repeats, so a busy host inflates them least:
  * the step graph: what a SmolLM2 decode step replays (node kinds), and the replay's time with the kernels'
    pool at 1 and at 2 threads (the same graph, inputs and KV cache; single replays);
  * the replay's per-call cost: graphs of 600 no-op-sized calls (`aten::view`, `aten::empty`, a 16-element
    `pagellm::rms_norm`), CPU time per node; and the same rms_norm called from a Python loop;
  * the pool's fork/join cost per parallel region: a decode-attention call over 16 keys (3 work items, no
    merge: almost no work) at 1 and 2 threads;
  * the split of each projection of the model across threads: `linear_small_m` at every weight shape of a
    layer, weights cycled through copies of >= 256 MB in all (past any LLC) so each call streams from memory, 1 vs 2
    threads (GB/s of weight read; the ratio shows how evenly a region's chunks split). The region and linear
    probes time single calls and keep the fastest, which a busy host disturbs least.
Writes benchmarks/results/fixed_costs_<tag>.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import common as C
import torch


def timed(fn, n: int, reps: int, clock=time.perf_counter) -> tuple[float, float]:
    """(min, median) microseconds per call of fn over `reps` batches of `n` calls."""
    for _ in range(min(n, 20)):
        fn()
    per = []
    for _ in range(reps):
        t = clock()
        for _ in range(n):
            fn()
        per.append((clock() - t) / n * 1e6)
    return min(per), statistics.median(per)


def set_threads(n: int) -> None:
    from pagellm import _C

    s = _C.thread_pool_info()
    _C.configure_thread_pool(num_threads=n, bind=s["bind"], spin_us=s["spin_us"],
                             chunks_per_thread=s["chunks_per_thread"], max_backoff_ms=s["max_backoff_ms"],
                             home_sections=s["home_sections"], prefetch_kb=s["prefetch_kb"])


def step_graph_probe(reps: int) -> dict:
    """The default model's decode step graph: node kinds, replay ms at 1 and 2 threads."""
    from pagellm import LLM, SamplingParams
    from pagellm.step_graph import graph_cache

    recordings = []
    build = graph_cache.build_step_graph

    def keep(recording, output_slots):
        recordings.append(recording)
        return build(recording, output_slots)
    graph_cache.build_step_graph = keep
    try:
        llm = LLM(dtype="bfloat16", max_model_len=512, max_num_seqs=1, kv_cache_memory_gb=0.25, block_size=16, seed=0)
        cache = llm.llm_engine.runner.step_graphs
        seen = {}
        run = cache.run

        def spy(key, inputs, step):
            seen["key"], seen["inputs"] = key, inputs
            return run(key, inputs, step)
        cache.run = spy
        llm.generate([{"prompt_token_ids": list(range(100, 356))}],
                     SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))
    finally:
        graph_cache.build_step_graph = build
    graph, inputs = cache._graphs[seen["key"]], seen["inputs"]
    kinds = collections.Counter(c.name for c in recordings[-1].calls)
    replay = {}
    for n in (1, 2, 1, 2):
        set_threads(n)
        mn, md = timed(lambda: graph.run(inputs), 1, 30 * reps)  # single replays: the fastest is the least disturbed
        best = replay.get(n, (float("inf"), float("inf")))
        replay[n] = (min(best[0], mn / 1e3), min(best[1], md / 1e3))
    set_threads(0)
    return {"num_nodes": graph.num_nodes, "kinds": dict(kinds.most_common()), "replay_ms": replay}


def replay_per_call(reps: int) -> dict:
    """CPU microseconds per node of graphs of no-op-sized calls, and per eager Python call."""
    from pagellm import _C

    n = 600
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    graphs = {}
    g = _C.StepGraph(1)
    for i in range(n):
        g.add_node("aten::view", "", [("s", 0), ("c", [16])], [(0, -1, i + 1)])
    graphs["aten::view"] = g
    g = _C.StepGraph(1)
    for i in range(n):
        g.add_node("aten::empty", "memory_format", [("c", [1, 576]), ("c", torch.bfloat16), ("d",),
                                                   ("c", torch.device("cpu")), ("d",), ("d",)], [(0, -1, i + 1)])
    graphs["aten::empty [1, 576]"] = g
    g = _C.StepGraph(1)
    for _ in range(n):
        g.add_node("pagellm::rms_norm", "", [("s", 0), ("s", 0), ("c", w), ("c", 1e-6)], [])
    graphs["pagellm::rms_norm [1, 16]"] = g
    out = {}
    for name, g in graphs.items():
        g.finalize([0])
        out[f"replayed {name}"] = timed(lambda g=g: g.run([x]), 50, reps, time.process_time)[0] / n
    rms = torch.ops.pagellm.rms_norm.default

    def eager():
        for _ in range(n):
            rms(x, x, w, 1e-6)
    out["eager Python call of pagellm::rms_norm [1, 16]"] = timed(eager, 10, reps, time.process_time)[0] / n
    return out


def region_cost(reps: int) -> dict:
    """Wall microseconds of a near-empty parallel region (decode attention over 16 keys) at 1 and 2 threads."""
    dec = torch.ops.pagellm.paged_attention_decode.default
    H, G, D, B = 3, 3, 64, 16
    kc = torch.randn(8, H, B, D, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(1, H * G, D, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    bt = torch.arange(8, dtype=torch.int32).view(1, 8)
    sl = torch.tensor([16], dtype=torch.int32)
    res = {}
    for n in (1, 2, 1, 2):
        set_threads(n)
        mn, md = timed(lambda: dec(out, q, kc, vc, bt, sl, 0.125), 1, 300 * reps)
        best = res.get(n, (float("inf"), float("inf")))
        res[n] = (min(best[0], mn), min(best[1], md))
    set_threads(0)
    return res


def linear_split(reps: int) -> list[dict]:
    """GB/s of weight streamed by linear_small_m (M = 1) at each SmolLM2-135M projection, 1 and 2 threads."""
    lin = torch.ops.pagellm.linear_small_m.default
    shapes = {"qkv_proj": (832, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
    rows = []
    for name, (n_out, k) in shapes.items():
        copies = -(-(256 << 20) // (n_out * k * 2))
        ws = [torch.randn(n_out, k, dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, dtype=torch.bfloat16)
        y = torch.empty(1, n_out, dtype=torch.bfloat16)
        nbytes = n_out * k * 2
        state = [0]

        def call():
            state[0] = (state[0] + 1) % copies
            lin(y, x, ws[state[0]], None)
        us = {}
        for n in (1, 2, 1, 2):
            set_threads(n)
            # single calls, the fastest: a call no other process interrupted (a busy host still gets some)
            us[n] = min(us.get(n, float("inf")), timed(call, 1, 100 * reps)[0])
        rows.append({"op": name, "shape": [n_out, k], "kb": nbytes / 1e3,
                     "us": us, "gbs": {n: nbytes / (t * 1e3) for n, t in us.items()}})
    set_threads(0)
    return rows


def render(data: dict) -> str:
    sg = data["graph"]
    out = [f"# Batch-1 decode fixed costs ({data['tag']})", "",
           f"{data['env']['cpu']}; 1-min load {data['load_before'][0]:.2f} before, {data['load_after'][0]:.2f} after; "
           f"minimum (median) over {data['reps']} repeats (single calls: over 30-300 x that many).", "",
           f"## Step graph: {sg['num_nodes']} nodes", "",
           ", ".join(f"{k} {v}" for k, v in sg["kinds"].items()), "",
           C.md_table(["threads", "replay ms min", "replay ms median"],
                      [[n, f"{v[0]:.3f}", f"{v[1]:.3f}"] for n, v in sorted(sg["replay_ms"].items())]),
           "", "## Replay per-call cost (CPU us per node)", "",
           C.md_table(["graph of 600", "us / node"], [[k, f"{v:.3f}"] for k, v in data["per_call"].items()]),
           "", "## Pool fork/join: a near-empty region (decode attention over 16 keys)", "",
           C.md_table(["threads", "us min", "us median"],
                      [[n, f"{v[0]:.2f}", f"{v[1]:.2f}"] for n, v in sorted(data["region"].items())]),
           "", "## Projections split across threads (linear_small_m, M = 1, weights from memory)", "",
           C.md_table(["op", "weight KB", "1 thread us", "2 threads us", "1 thread GB/s", "2 threads GB/s",
                       "speed-up"],
                      [[r["op"], f"{r['kb']:.0f}", f"{r['us'][1]:.1f}", f"{r['us'][2]:.1f}", f"{r['gbs'][1]:.1f}",
                        f"{r['gbs'][2]:.1f}", f"{r['us'][1] / r['us'][2]:.2f}x"] for r in data["linear"]])]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--pagellm-src", default=None, help="import pagellm from this python/ dir (another checkout)")
    ap.add_argument("--tag", default="default")
    args = ap.parse_args()
    if args.pagellm_src:
        from bench_step_profile import use_pagellm_from

        use_pagellm_from(args.pagellm_src)
    import pagellm.ops  # noqa: F401  (loads the kernels)

    load_before = C.loadavg()
    data = {"tag": args.tag, "env": C.env_info(), "reps": args.reps, "load_before": load_before,
            "graph": step_graph_probe(args.reps), "per_call": replay_per_call(args.reps),
            "region": region_cost(args.reps), "linear": linear_split(args.reps), "load_after": C.loadavg()}
    md = render(data)
    print("\n" + md)
    C.save_results(f"fixed_costs_{args.tag}", md, data)


if __name__ == "__main__":
    main()
