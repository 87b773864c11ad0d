"""Prometheus metrics of the server, in a per-app CollectorRegistry (never the global one).

Latencies are measured at the server, on the event loop, when each output reaches the request's
handler: TTFT (arrival -> first generated token), inter-token latency (between successive outputs,
per token), end-to-end latency, and queue time (arrival -> first scheduled, from the engine's
RequestMetrics when it has them). Gauges are refreshed from the engine thread's stats snapshot at
scrape time; so are the speculative-decoding counters (vLLM's names: drafts, draft tokens, accepted
tokens, both per draft position too), advanced by the change since the last scrape.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("pagellm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagellm:inter_token_latency_seconds", "Inter-token latency (per token).", labels,
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pagellm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pagellm:request_queue_time_seconds", "Time a request waited to be scheduled.",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pagellm:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("pagellm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.request_success = Counter("pagellm:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.running = Gauge("pagellm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("pagellm:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                             registry=r)
        self.kv_usage = Gauge("pagellm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", labels,
                              registry=r)
        self.kv_blocks_in_use = Gauge("pagellm:kv_cache_blocks_in_use",
                                      "KV-cache blocks held by requests (cached-but-free prefix blocks are free).",
                                      labels, registry=r)
        self.prefix_hit_rate = Gauge("pagellm:prefix_cache_hit_rate",
                                     "Prefix-cache hit rate (hit tokens / queried tokens, cumulative).", labels,
                                     registry=r)
        self.prefix_queries = Gauge("pagellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                    labels, registry=r)
        self.prefix_hits = Gauge("pagellm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                 registry=r)
        self.kv_bytes_per_token = Gauge("pagellm:kv_cache_bytes_per_token",
                                        "KV-cache bytes one token of context takes over all layers (scales "
                                        "included; shared layers add none).", labels, registry=r)
        self.spec = SpecDecodeCounters(r, labels)
        self.model_name = model_name
        self._l = {"model_name": model_name}

    def tracker(self, arrival_time: float | None = None) -> "RequestTracker":
        return RequestTracker(self, time.time() if arrival_time is None else arrival_time)

    def render(self, stats) -> bytes:
        if stats is not None:
            self.running.labels(**self._l).set(stats.num_running)
            self.waiting.labels(**self._l).set(stats.num_waiting)
            self.kv_usage.labels(**self._l).set(stats.kv_cache_usage)
            if stats.num_total_blocks is not None and stats.num_free_blocks is not None:
                self.kv_blocks_in_use.labels(**self._l).set(stats.num_total_blocks - stats.num_free_blocks)
            self.prefix_hit_rate.labels(**self._l).set(stats.prefix_cache_hit_rate)
            self.prefix_queries.labels(**self._l).set(stats.prefix_cache_queries)
            self.prefix_hits.labels(**self._l).set(stats.prefix_cache_hits)
            if getattr(stats, "kv_cache_bytes_per_token", None) is not None:
                self.kv_bytes_per_token.labels(**self._l).set(stats.kv_cache_bytes_per_token)
            if getattr(stats, "spec_decode", None) is not None:
                self.spec.advance(stats.spec_decode, self._l)
        return generate_latest(self.registry)


class SpecDecodeCounters:
    """Prometheus counters following the engine's cumulative SpecDecodeStats. A snapshot below the last
    one seen (the proposer was replaced, which restarts the engine's counts) counts from zero again."""

    _FIELDS = {"num_drafts": "num_spec_rows", "num_draft_tokens": "num_draft_tokens",
               "num_accepted_tokens": "num_accepted_draft_tokens", "num_emitted_tokens": "num_emitted_tokens",
               "num_proposer_errors": "num_proposer_errors"}
    _HELP = {"num_drafts": "Rows that carried draft tokens (one per sequence and step).",
             "num_draft_tokens": "Draft tokens scored by the target model.",
             "num_accepted_tokens": "Draft tokens accepted by verification.",
             "num_emitted_tokens": "Tokens spec rows added to outputs (accepted drafts + the target's own).",
             "num_proposer_errors": "Steps run without drafts because the proposer raised."}

    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        self.totals = {name: Counter(f"pagellm:spec_decode_{name}", self._HELP[name], labels, registry=registry)
                       for name in self._FIELDS}
        pos = labels + ["position"]
        self.per_pos = {
            "num_drafts_per_position": Counter("pagellm:spec_decode_num_draft_tokens_per_pos",
                                               "Draft tokens scored, by draft position (0 = first).", pos,
                                               registry=registry),
            "num_accepted_per_position": Counter("pagellm:spec_decode_num_accepted_tokens_per_pos",
                                                 "Draft tokens accepted, by draft position (0 = first).", pos,
                                                 registry=registry),
        }
        self._last: dict[tuple[str, int], int] = {}

    def _delta(self, key: tuple[str, int], value: int) -> int:
        last = self._last.get(key, 0)
        self._last[key] = value
        return value - last if value >= last else value

    def advance(self, stats, label_values: dict) -> None:
        for name, attr in self._FIELDS.items():
            delta = self._delta((attr, -1), int(getattr(stats, attr)))
            self.totals[name].labels(**label_values).inc(delta)
        for attr, counter in self.per_pos.items():
            for i, value in enumerate(getattr(stats, attr)):
                counter.labels(position=str(i), **label_values).inc(self._delta((attr, i), int(value)))


class RequestTracker:
    """Per-request latency bookkeeping; call on_output for each RequestOutput, then finish."""

    __slots__ = ("m", "arrival", "first_token", "last_time", "last_count", "done")

    def __init__(self, m: ServerMetrics, arrival: float) -> None:
        self.m = m
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_time = arrival
        self.last_count = 0
        self.done = False

    def on_output(self, out) -> None:
        now = time.time()
        count = max((len(c.token_ids) for c in out.outputs), default=0)
        if count <= self.last_count:
            return
        lab = self.m._l
        if self.first_token is None:
            self.first_token = now
            self.m.ttft.labels(**lab).observe(now - self.arrival)
            tq = getattr(getattr(out, "metrics", None), "time_in_queue", None)
            if tq is not None:
                self.m.queue.labels(**lab).observe(max(0.0, tq))
        else:
            new = count - self.last_count
            per_tok = (now - self.last_time) / new
            h = self.m.itl.labels(**lab)
            for _ in range(new):
                h.observe(per_tok)
        self.last_time = now
        self.last_count = count

    def finish(self, out, num_prompt_tokens: int, finish_reason: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        lab = self.m._l
        self.m.e2e.labels(**lab).observe(time.time() - self.arrival)
        self.m.prompt_tokens.labels(**lab).inc(num_prompt_tokens)
        if out is not None:
            gen = sum(len(c.token_ids) for c in out.outputs)
            self.m.generation_tokens.labels(**lab).inc(gen)
            reasons = {c.finish_reason or "abort" for c in out.outputs} if finish_reason is None else {finish_reason}
        else:
            reasons = {finish_reason or "abort"}
        for reason in reasons:
            self.m.request_success.labels(finished_reason=reason, **lab).inc()
