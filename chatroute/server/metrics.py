"""Prometheus metrics of the service: requests, routes, provider attempts, failovers, embedder."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from chatroute.server.tracing import RequestTrace

__all__ = ["PROMETHEUS_CONTENT_TYPE", "ServiceMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class ServiceMetrics:
    """The metrics of one app, in a registry of their own (so several apps can coexist)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "chatroute_requests",
            "HTTP requests answered, by endpoint, route and status code.",
            ["endpoint", "route", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "chatroute_request_duration_seconds",
            "Time to answer (to the last byte of a stream), by endpoint and route.",
            ["endpoint", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route_decisions = Counter(
            "chatroute_route_decisions",
            "Routing decisions, by route and whether the default route was the fallback.",
            ["route", "default"],
            registry=r,
        )
        self.attempts = Counter(
            "chatroute_provider_attempts",
            "Provider attempts, by route, provider and outcome.",
            ["route", "provider", "outcome"],
            registry=r,
        )
        self.attempt_latency = Histogram(
            "chatroute_provider_attempt_duration_seconds",
            "Active time of one provider attempt, by route and provider.",
            ["route", "provider"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "chatroute_provider_time_to_first_token_seconds",
            "Time to the first streamed update of a provider attempt.",
            ["route", "provider"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.failovers = Counter(
            "chatroute_failovers",
            "Requests moved to the next provider after a failure, by route and failed provider.",
            ["route", "provider"],
            registry=r,
        )
        self.embed_batch_size = Histogram(
            "chatroute_embedder_batch_size",
            "Texts per embedder forward pass.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.embed_batch_tokens = Histogram(
            "chatroute_embedder_batch_tokens",
            "Tokens per embedder forward pass.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.embed_queue_depth = Gauge(
            "chatroute_embedder_queue_depth",
            "Texts waiting for the embedder.",
            registry=r,
        )
        self.classify_batch_size = Histogram(
            "chatroute_classify_batch_size",
            "Inputs per /v1/classify request.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.ready = Gauge("chatroute_ready", "1 when the service is ready.", registry=r)

    def watch_queue_depth(self, read: Callable[[], float]) -> None:
        """Report the embedder's queue depth by calling `read` at each scrape."""
        self.embed_queue_depth.set_function(read)

    def observe_batch(self, batch_size: int, tokens: int) -> None:
        """Record one embedder forward pass (a batch listener)."""
        self.embed_batch_size.observe(batch_size)
        self.embed_batch_tokens.observe(tokens)

    def observe_trace(self, trace: RequestTrace) -> None:
        """Record the attempts and failovers of one finished chat request."""
        for record in trace.attempts:
            self.attempts.labels(record.route, record.provider, record.outcome).inc()
            attempt = record.attempt
            self.attempt_latency.labels(record.route, record.provider).observe(attempt.duration)
            if attempt.time_to_first_update is not None:
                self.first_token.labels(record.route, record.provider).observe(
                    attempt.time_to_first_update
                )
        for route, provider in trace.selections[:-1]:
            self.failovers.labels(route, provider).inc()

    def observe_request(self, endpoint: str, route: str, status: int, seconds: float) -> None:
        """Record one answered request."""
        self.requests.labels(endpoint, route, str(status)).inc()
        self.request_latency.labels(endpoint, route).observe(seconds)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
