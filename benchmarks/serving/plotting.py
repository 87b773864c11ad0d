"""PNG of latency (TTFT / TPOT / E2E, p50 and p99) and goodput versus request rate, one line per
server label."""

from __future__ import annotations


def plot_sweep(runs: list[dict], path: str, title: str = "") -> str:
    """runs: result dicts with 'label', 'request_rate' and the summary keys of metrics.summarize."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "E2E latency (ms)"), ("goodput", "req/s")]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    labels = sorted({r.get("label", "") for r in runs})

    def rate_of(r):
        rate = r["request_rate"]
        return float("inf") if rate in ("inf", None) else float(rate)

    finite = [rate_of(r) for r in runs if rate_of(r) != float("inf")]
    inf_x = (max(finite) * 1.5) if finite else 1.0
    for label in labels:
        rs = sorted((r for r in runs if r.get("label", "") == label), key=rate_of)
        xs = [inf_x if rate_of(r) == float("inf") else rate_of(r) for r in rs]
        for ax, (key, ylabel) in zip(axes, panels):
            if key == "goodput":
                ax.plot(xs, [r.get("goodput", 0.0) for r in rs], "o-", label=f"{label} goodput")
                ax.plot(xs, [r["request_throughput"] for r in rs], "x:", label=f"{label} throughput")
            else:
                ax.plot(xs, [r[f"median_{key}_ms"] for r in rs], "o-", label=f"{label} p50")
                ax.plot(xs, [r[f"p99_{key}_ms"] for r in rs], "x--", label=f"{label} p99")
            ax.set_xlabel("request rate (req/s; rightmost = inf)" if inf_x in xs else "request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=7)
    slo = next((r.get("slos_ms") for r in runs if r.get("slos_ms")), None)
    if slo:
        if "ttft" in slo:
            axes[0].axhline(slo["ttft"], color="r", lw=0.8, ls=":")
        if "tpot" in slo:
            axes[1].axhline(slo["tpot"], color="r", lw=0.8, ls=":")
    fig.suptitle(title or "serving latency vs request rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
