"""Summary statistics of a benchmark run: TTFT, TPOT, ITL, E2E (mean/p50/p90/p99, ms),
request and token throughput, and goodput under SLOs (requests/s meeting every SLO)."""

from __future__ import annotations

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:1000', 'tpot:100'] -> {'ttft': 1000.0, 'tpot': 100.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.split(","):
            if not part.strip():
                continue
            k, _, v = part.partition(":")
            k = k.strip().lower()
            if k not in SLO_KEYS or not v:
                raise ValueError(f"bad --goodput item {part!r}: use ttft:MS, tpot:MS or e2el:MS")
            slos[k] = float(v)
    return slos


def _stats(values_s: list[float], prefix: str) -> dict[str, float]:
    arr = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.asarray([0.0])
    return {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.percentile(arr, 50)),
            f"p90_{prefix}_ms": float(np.percentile(arr, 90)), f"p99_{prefix}_ms": float(np.percentile(arr, 99)),
            f"std_{prefix}_ms": float(arr.std())}


def tpot_of(r) -> float | None:
    if r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def meets_slos(r, slos: dict[str, float]) -> bool:
    t = tpot_of(r)
    if "ttft" in slos and r.ttft * 1000 > slos["ttft"]:
        return False
    if "tpot" in slos and t is not None and t * 1000 > slos["tpot"]:
        return False
    return not ("e2el" in slos and r.latency * 1000 > slos["e2el"])


def per_request(r, slos: dict[str, float] | None) -> dict:
    """One request's record in the result JSON: what it was and how it went (ms)."""
    t = tpot_of(r)
    rec = {"kind": r.kind, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens, "success": r.success,
           "start_time": r.start_time, "ttft_ms": r.ttft * 1000, "tpot_ms": None if t is None else t * 1000,
           "e2el_ms": r.latency * 1000}
    if slos:
        rec["good"] = bool(r.success and meets_slos(r, slos))
    return rec


def summarize(results, duration_s: float, slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    s = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
    }
    for vals, name in ((ttfts, "ttft"), (tpots, "tpot"), (itls, "itl"), (e2els, "e2el")):
        s.update(_stats(vals, name))
    s["requests"] = [per_request(r, slos) for r in results]
    if slos:
        good = sum(rec["good"] for rec in s["requests"])
        s["slos_ms"] = slos
        s["good_requests"] = good
        s["goodput"] = good / duration_s if duration_s else 0.0
    errors = [r.error for r in results if not r.success]
    if errors:
        s["first_errors"] = errors[:5]
    return s


def format_summary(s: dict, label: str = "") -> str:
    lines = [f"==== {label} ====" if label else "===="]
    lines.append(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']:.2f} s")
    lines.append(f"request throughput {s['request_throughput']:.3f} req/s   output {s['output_throughput']:.1f} tok/s"
                 f"   total {s['total_token_throughput']:.1f} tok/s")
    if "goodput" in s:
        lines.append(f"goodput {s['goodput']:.3f} req/s ({s['good_requests']} requests meet {s['slos_ms']})")
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"{name.upper():5s} ms  mean {s[f'mean_{name}_ms']:9.1f}  p50 {s[f'median_{name}_ms']:9.1f}  "
                     f"p90 {s[f'p90_{name}_ms']:9.1f}  p99 {s[f'p99_{name}_ms']:9.1f}")
    if s.get("cpu_steal") is not None:
        lines.append(f"cpu steal {100 * s['cpu_steal']:.0f} % (time the host took from this machine)")
    if s.get("first_errors"):
        lines.append(f"errors: {s['first_errors'][:2]}")
    return "\n".join(lines)
