#!/usr/bin/env python3
"""One Markdown table of a serving comparison: every server at every request rate, from the JSON results
bench_serving.py wrote into a directory, plus pagellm's goodput ratio to each peer at the same rate; and
a second table of SLO capacity: the highest measured request rate up to which every measured rate had at
least X % of its requests meet both SLOs (DistServe's definition of goodput as a rate), per server, and
pagellm's ratio to each peer; and a third of good requests per request class, from the per-request records.

    python benchmarks/serving/summarize.py benchmarks/results/serving-<tag> > summary.md
"""

from __future__ import annotations

import glob
import json
import os
import sys
from collections import defaultdict


def load(directory: str) -> dict[str, dict[float, dict]]:
    runs: dict[str, dict[float, dict]] = defaultdict(dict)
    for path in sorted(glob.glob(os.path.join(directory, "*-rate*.json"))):
        with open(path) as f:
            s = json.load(f)
        rate = float("inf") if s["request_rate"] == "inf" else float(s["request_rate"])
        runs[s["label"]][rate] = s  # a later run of the same label and rate replaces an earlier one
    return runs


def meets_slo(s: dict) -> bool:
    """The server keeps up at this rate: the median request meets both SLOs."""
    slos = s.get("slos_ms", {})
    return s["median_ttft_ms"] <= slos.get("ttft", float("inf")) and s["median_tpot_ms"] <= slos.get("tpot", float("inf"))


def table(runs: dict[str, dict[float, dict]], ours: str = "pagellm") -> str:
    head = ("| server | rate req/s | done | req/s | out tok/s | TTFT p50 / p90 ms | TPOT p50 / p90 ms | "
            "ITL p50 ms | goodput req/s | good % | median meets SLO | pagellm goodput / this | cpu steal % |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ours_runs = next((r for label, r in runs.items() if label.startswith(ours)), {})
    for label in sorted(runs, key=lambda x: (not x.startswith(ours), x)):
        for rate in sorted(runs[label]):
            s = runs[label][rate]
            n = s["completed"] + s["failed"]
            good = s.get("goodput", 0.0)
            ratio = ""
            if not label.startswith(ours) and rate in ours_runs:
                mine = ours_runs[rate].get("goodput", 0.0)
                ratio = f"{mine / good:.2f}x" if good > 0 else ("inf" if mine > 0 else "-")
            steal = s.get("cpu_steal")
            lines.append(
                f"| {label} | {rate:g} | {s['completed']}/{n} | {s['request_throughput']:.3f} | "
                f"{s['output_throughput']:.1f} | {s['median_ttft_ms']:.0f} / {s['p90_ttft_ms']:.0f} | "
                f"{s['median_tpot_ms']:.1f} / {s['p90_tpot_ms']:.1f} | {s['median_itl_ms']:.1f} | {good:.3f} | "
                f"{100 * s.get('good_requests', 0) / max(n, 1):.0f} | {'yes' if meets_slo(s) else 'no'} | {ratio} | "
                f"{'-' if steal is None else f'{100 * steal:.0f}'} |"
            )
    return "\n".join(lines)


ATTAINMENTS = (90, 80, 50)


def capacity(runs_of_label: dict[float, dict], attainment: float) -> float:
    """SLO capacity: the highest measured rate R such that every measured rate up to R had an SLO attainment
    (good requests / all) of at least `attainment` %; 0 if the lowest rate already missed it. A rate that
    passes above one that failed does not count (noise, or a draw of easy requests, is not capacity)."""
    best = 0.0
    for rate in sorted(r for r in runs_of_label if r != float("inf")):
        s = runs_of_label[rate]
        n = s["completed"] + s["failed"]
        if not n or 100 * s.get("good_requests", 0) / n < attainment:
            break
        best = rate
    return best


def capacity_table(runs: dict[str, dict[float, dict]], ours: str = "pagellm") -> str:
    head = ("| server | rates measured | " + " | ".join(f"max rate with >= {a} % good" for a in ATTAINMENTS)
            + " | pagellm / this, " + " / ".join(f"{a} %" for a in ATTAINMENTS) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    mine = next(({a: capacity(r, a) for a in ATTAINMENTS} for label, r in runs.items() if label.startswith(ours)), {})
    for label in sorted(runs, key=lambda x: (not x.startswith(ours), x)):
        caps = {a: capacity(runs[label], a) for a in ATTAINMENTS}
        ratios = ""
        if not label.startswith(ours) and mine:
            def ratio(a: int) -> str:
                if caps[a]:
                    return f"{mine[a] / caps[a]:.1f}x"
                return f"{mine[a]:g} vs none" if mine[a] else "-"

            ratios = " / ".join(ratio(a) for a in ATTAINMENTS)
        rates = ", ".join(f"{r:g}" for r in sorted(runs[label]))
        lines.append(f"| {label} | {rates} | " + " | ".join(f"{caps[a]:g}" if caps[a] else "none"
                                                            for a in ATTAINMENTS) + f" | {ratios} |")
    return "\n".join(lines)


def class_table(runs: dict[str, dict[float, dict]], ours: str = "pagellm") -> str:
    """Good requests per request class (from the per-request records), per server and rate: which kinds of
    request miss the SLOs, and on which side (TTFT or TPOT)."""
    kinds = sorted({q.get("kind") or "?" for r in runs.values() for s in r.values() for q in s.get("requests", [])})
    if not kinds:
        return ""
    head = "| server | rate req/s | " + " | ".join(f"{k}: good / n (TTFT miss, TPOT miss)" for k in kinds) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label in sorted(runs, key=lambda x: (not x.startswith(ours), x)):
        for rate in sorted(runs[label]):
            s = runs[label][rate]
            slos = s.get("slos_ms", {})
            cells = []
            for k in kinds:
                qs = [q for q in s.get("requests", []) if (q.get("kind") or "?") == k]
                good = sum(bool(q.get("good")) for q in qs)
                ttft = sum(q["success"] and q["ttft_ms"] > slos.get("ttft", float("inf")) for q in qs)
                tpot = sum(q["success"] and (q["tpot_ms"] or 0) > slos.get("tpot", float("inf")) for q in qs)
                cells.append(f"{good} / {len(qs)} ({ttft}, {tpot})" if qs else "-")
            lines.append(f"| {label} | {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit(__doc__)
    runs = load(argv[0])
    any_run = next(iter(next(iter(runs.values())).values()))
    print(f"SLOs (ms): {any_run.get('slos_ms')}; {any_run['num_prompts']} requests per rate, "
          f"dataset {any_run['dataset']}.\n")
    print(table(runs))
    print("\nSLO capacity: the highest measured request rate R such that at every measured rate up to R at least "
          "X % of the requests met both SLOs (rates between the measured ones are not interpolated).\n")
    print(capacity_table(runs))
    by_class = class_table(runs)
    if by_class:
        print("\nGood requests by request class (runs that saved per-request records):\n")
        print(by_class)


if __name__ == "__main__":
    main(sys.argv[1:])
