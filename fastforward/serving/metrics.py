"""The server's Prometheus metrics (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fastforward.decoding.metrics import tpf


class Metrics:
    """Requests, generated tokens, forwards, queries, tokens per forward, queue depth, batch size, latency."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fastforward_requests", "completion requests received", ["endpoint"], registry=r)
        self.failures = Counter("fastforward_failed_requests", "requests failed inside decoding", registry=r)
        self.cancelled = Counter("fastforward_cancelled_requests", "requests whose client left early", registry=r)
        self.refused = Counter(
            "fastforward_refused_requests", "requests refused with 503: the queue was full", registry=r
        )
        self.tokens = Counter("fastforward_generated_tokens", "tokens generated", registry=r)
        self.forwards = Counter("fastforward_forwards", "decoding forwards (per request)", registry=r)
        self.queries = Counter(
            "fastforward_queries", "tokens the decoding forwards ran, drafts included (per request)", registry=r
        )
        self.queue_depth = Gauge("fastforward_queue_depth", "requests waiting to be admitted", registry=r)
        self.batch_size = Gauge("fastforward_batch_size", "requests being decoded (rows of every group)", registry=r)
        self.step_rows = Histogram(
            "fastforward_step_rows", "rows in each decoding step", buckets=(1, 2, 3, 4, 8, 16, 32, 64), registry=r
        )
        self.tpf = Histogram(
            "fastforward_tokens_per_forward",
            "tokens per forward of each request",
            buckets=(1, 1.5, 2, 3, 4, 6, 8, 12, 16),
            registry=r,
        )
        self.latency = Histogram(
            "fastforward_request_latency_seconds",
            "time from request to its last token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )

    def observe(self, nfe: int, tokens: int, seconds: float, queries: int) -> None:
        self.tokens.inc(tokens)
        self.forwards.inc(nfe)
        self.queries.inc(queries)
        if tokens:
            self.tpf.observe(tpf(tokens, nfe))
        self.latency.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
