"""`pagellm bench serve` (benchmarks/bench_serving.py) against a live server: every rate completes its own
requests, and no rate re-sends a prompt the server has already seen (warm-up or an earlier rate)."""

from __future__ import annotations

import argparse
import json

import pytest

from pagellm.entrypoints import bench


def _parse(argv):
    p = argparse.ArgumentParser()
    bench.add_bench_parser(p.add_subparsers(dest="command", required=True))
    return p.parse_args(argv)


def test_split_requests_gives_each_rate_fresh_prompts():
    bs = bench._load()
    pool = list(range(1 + 3 * 4))
    warm, per_rate = bs.split_requests(pool, 1, 4, 3)
    assert warm == [0] and [len(r) for r in per_rate] == [4, 4, 4]
    seen = set(warm)
    for reqs in per_rate:
        assert not seen & set(reqs)
        seen |= set(reqs)
    warm, per_rate = bs.split_requests(pool[:6], 1, 4, 3)  # too few: reused, never more than asked
    assert [len(r) for r in per_rate] == [4, 4, 4] and per_rate[0] == per_rate[2]


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
    saved = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert sum(n.endswith(".json") for n in saved) == 2 and any(n.endswith(".png") for n in saved)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
