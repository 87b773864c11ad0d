"""`pagellm bench serve` (benchmarks/bench_serving.py) against a live server: every rate completes its
requests; and each rate draws its own requests (the same ones for every server), distinct from other rates'
and the warm-up's."""

from __future__ import annotations

import argparse
import json

import pytest

from pagellm.entrypoints import bench


def _parse(argv):
    p = argparse.ArgumentParser()
    bench.add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_each_rate_draws_its_own_requests():
    """A rate's requests depend only on the seed and the rate (the same for every server and sweep), differ
    from other rates' and from the warm-up's, so no prefix cache sees a measured prompt twice."""
    bs = bench._load()
    args = _parse(["bench", "serve", "--num-prompts", "12"])
    at = {r: [q.prompt for q in bs.build_requests(args, 12, bs.rate_seed(0, r))] for r in (0.2, 0.6, float("inf"))}
    assert at[0.2] == [q.prompt for q in bs.build_requests(args, 12, bs.rate_seed(0, 0.2))]
    warm = [q.prompt for q in bs.build_requests(args, 4, bs.WARMUP_SEED_OFFSET)]
    long_ones = {r: {p for p in ps if len(p) > 400} for r, ps in at.items()}  # passages: a repeat is a cache hit
    assert long_ones[0.2] and not long_ones[0.2] & long_ones[0.6] and not long_ones[0.6] & long_ones[float("inf")]
    assert not set(warm) & (long_ones[0.2] | long_ones[0.6])


def test_builtin_mixes():
    """--builtin-mix picks the kinds: `chat` is the questions alone; `mixed` holds all three kinds; the prompts a
    one-kind mix draws are that kind's; an unknown mix is a clear error."""
    bs = bench._load()
    from serving.datasets import builtin_requests

    chat = bs.build_requests(_parse(["bench", "serve", "--builtin-mix", "chat"]), 40, 3)
    assert len(chat) == 40 and {r.kind for r in chat} == {"question"}
    assert all(len(r.prompt) < 400 for r in chat)
    mixed = bs.build_requests(_parse(["bench", "serve"]), 60, 3)
    assert {r.kind for r in mixed} == {"question", "rag", "summarize"}
    summ = builtin_requests(8, 5, mix="summarize")
    assert {r.kind for r in summ} == {"summarize"} and min(len(r.prompt) for r in summ) > 2000
    with pytest.raises(ValueError, match="unknown built-in mix"):
        builtin_requests(4, 0, mix="sharegpt")
    with pytest.raises(SystemExit):
        _parse(["bench", "serve", "--builtin-mix", "sharegpt"])


def test_slo_capacity_stops_at_the_first_failing_rate():
    """SLO capacity counts a rate only if every lower measured rate also met the attainment level."""
    bench._load()  # puts benchmarks/ on sys.path
    from serving.summarize import capacity, class_table

    def run(good, n=10):
        return {"completed": n, "failed": 0, "good_requests": good}

    runs = {0.25: run(10), 0.5: run(8), 1.0: run(10), 2.0: run(4)}
    assert capacity(runs, 90) == 0.25      # 1.0 passes again, but 0.5 below it failed
    assert capacity(runs, 80) == 1.0
    assert capacity(runs, 30) == 2.0
    assert capacity({0.1: run(5)}, 90) == 0.0
    recs = [{"kind": "question", "success": True, "good": False, "ttft_ms": 1500.0, "tpot_ms": 20.0},
            {"kind": "question", "success": True, "good": True, "ttft_ms": 100.0, "tpot_ms": 20.0},
            {"kind": "rag", "success": True, "good": False, "ttft_ms": 100.0, "tpot_ms": 150.0}]
    table = class_table({"pagellm-x": {0.5: {"slos_ms": {"ttft": 1000.0, "tpot": 100.0}, "requests": recs}}})
    assert "| pagellm-x | 0.5 | 1 / 2 (1, 0) | 0 / 1 (0, 1) |" in table


def test_bench_serve_against_live_server(fake_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(1 + 2 * 4):
            f.write(json.dumps({"prompt": f"prompt number {i} about the sea", "output_len": 6}) + "\n")
    args = _parse(["bench", "serve", "--port", str(fake_server.port), "--dataset", str(data), "--num-prompts", "4",
                   "--request-rates", "inf,50", "--warmup", "1", "--goodput", "ttft:5000", "tpot:1000",
                   "--result-dir", str(tmp_path / "res")])
    runs = bench._load().main(args)
    assert [r["request_rate"] for r in runs] == ["inf", 50.0]
    for r in runs:
        assert r["completed"] == 4 and r["failed"] == 0 and r["num_prompts"] == 4
        assert r["total_output_tokens"] == 4 * 6
        assert r["good_requests"] == 4 and r["median_ttft_ms"] > 0
        assert len(r["requests"]) == 4 and all(q["good"] and q["output_tokens"] == 6 for q in r["requests"])
        assert r["cpu_steal"] is None or 0.0 <= r["cpu_steal"] <= 1.0
    saved = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert sum(n.endswith(".json") for n in saved) == 2 and any(n.endswith(".png") for n in saved)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
