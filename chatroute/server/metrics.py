"""Prometheus metrics of the service: requests, routes, provider attempts, failovers, embedder."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from chatroute.failover.breaker import BreakerState, CircuitBreakerRegistry
from chatroute.tracing import RequestTrace

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
            "Routing decisions, by endpoint (chat, route, classify), route and whether the "
            "default route was the fallback.",
            ["endpoint", "route", "default"],
            registry=r,
        )
        self.tokens = Counter(
            "chatroute_tokens",
            "Tokens the providers reported, by route, provider and kind (prompt, completion, "
            "cached: the prompt tokens read from a cache, reasoning: the completion tokens "
            "spent on reasoning).",
            ["route", "provider", "kind"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "chatroute_time_to_first_token_seconds",
            "Time from a streamed chat request's start to its first output, by route and the "
            "provider that served it.",
            ["route", "provider"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.scoring = Gauge(
            "chatroute_scoring_info",
            "1 for the scoring mode in use (its name in `mode`).",
            ["mode"],
            registry=r,
        )
        self.scoring_training = Gauge(
            "chatroute_scoring_training_seconds",
            "Seconds training the scoring head took (0 for modes that do not train).",
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
        self.breaker_transitions = Counter(
            "chatroute_breaker_transitions",
            "Circuit breaker state changes, by provider and the states left and entered.",
            ["provider", "from_state", "to_state"],
            registry=r,
        )
        self.shared_state_up = Gauge(
            "chatroute_shared_state_up",
            "1 while the breaker state shared through Redis is live (0: down or not used).",
            registry=r,
        )
        self.shared_breaker_events = Counter(
            "chatroute_shared_breaker_events",
            "Breaker openings and closings shared with other replicas, by direction.",
            ["direction"],
            registry=r,
        )
        self.sticky_sessions = Counter(
            "chatroute_sticky_sessions",
            "Answered chat requests of a conversation, by route and whether the conversation "
            "was new, kept its provider, switched route or failed over.",
            ["route", "outcome"],
            registry=r,
        )
        self.cancellations = Counter(
            "chatroute_cancelled_requests",
            "Chat requests cut short on the caller's side (disconnect or deadline), by route "
            "and whether output had reached the caller.",
            ["route", "reason", "stage"],
            registry=r,
        )
        self._breaker_collector: _BreakerCollector | None = None
        # Labelled children by (metric, label values): `labels()` validates and locks on
        # every call; the label sets here are few (routes x providers x outcomes).
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def labelled(self, metric: MetricWrapperBase, *values: str) -> Any:
        """`metric.labels(*values)`, kept: later calls skip the validation and the lock."""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def watch_breakers(self, breakers: CircuitBreakerRegistry) -> Callable[[], None]:
        """Export the state of every breaker in `breakers` and count their transitions.

        Returns the undo (stop exporting; transitions stop being counted).
        """
        if self._breaker_collector is not None:
            self.registry.unregister(self._breaker_collector)
        collector = _BreakerCollector(breakers)
        self.registry.register(collector)
        self._breaker_collector = collector
        active = True

        def count(provider: str, old: BreakerState, new: BreakerState) -> None:
            if active:
                self.breaker_transitions.labels(provider, old.value, new.value).inc()

        breakers.add_listener(count)

        def undo() -> None:
            nonlocal active
            active = False
            if self._breaker_collector is collector:
                self.registry.unregister(collector)
                self._breaker_collector = None

        return undo

    def watch_queue_depth(self, read: Callable[[], float]) -> None:
        """Report the embedder's queue depth by calling `read` at each scrape."""
        self.embed_queue_depth.set_function(read)

    def observe_batch(self, batch_size: int, tokens: int) -> None:
        """Record one embedder forward pass (a batch listener)."""
        self.embed_batch_size.observe(batch_size)
        self.embed_batch_tokens.observe(tokens)

    def observe_trace(self, trace: RequestTrace) -> None:
        """Record the attempts and failovers of one finished chat request."""
        child = self.labelled
        for record in trace.attempts:
            child(self.attempts, record.route, record.provider, record.outcome).inc()
            attempt = record.attempt
            child(self.attempt_latency, record.route, record.provider).observe(attempt.duration)
            if attempt.time_to_first_update is not None:
                child(self.first_token, record.route, record.provider).observe(
                    attempt.time_to_first_update
                )
        for route, provider in trace.selections[:-1]:
            child(self.failovers, route, provider).inc()

    def observe_decision(self, endpoint: str, route: str, is_default: bool) -> None:
        """Count one routing decision of `endpoint` (chat, route or classify)."""
        default = "true" if is_default else "false"
        self.labelled(self.route_decisions, endpoint, route, default).inc()

    def observe_decisions(self, endpoint: str, decisions: Iterable[tuple[str, bool]]) -> None:
        """Count a batch of (route, is_default) decisions of `endpoint`."""
        for (route, is_default), count in collections.Counter(decisions).items():
            default = "true" if is_default else "false"
            self.labelled(self.route_decisions, endpoint, route, default).inc(count)

    def observe_output(self, trace: RequestTrace, started: float) -> None:
        """Count a finished chat request's tokens and its time to first output."""
        route, provider = trace.route or "", trace.provider or ""
        if trace.first_output_at is not None:
            self.labelled(self.time_to_first_token, route, provider).observe(
                max(0.0, trace.first_output_at - started)
            )
        usage = trace.usage
        if usage is None:
            return
        for kind, value in (
            ("prompt", usage.input_token_count),
            ("completion", usage.output_token_count),
            ("cached", usage.cached_input_token_count),
            ("reasoning", usage.reasoning_token_count),
        ):
            if value:
                self.labelled(self.tokens, route, provider, kind).inc(value)

    def set_scoring(self, mode: str, training_seconds: float | None) -> None:
        """Name the scoring mode in use and how long its training took."""
        self.scoring.clear()
        self.scoring.labels(mode).set(1)
        self.scoring_training.set(training_seconds or 0.0)

    def observe_cancellation(self, trace: RequestTrace) -> None:
        """Count a chat request its caller cut short (a disconnect or the deadline)."""
        if trace.cancelled is not None:
            stage = "after_output" if trace.committed else "before_output"
            self.cancellations.labels(trace.route or "", trace.cancelled, stage).inc()

    def observe_request(self, endpoint: str, route: str, status: int, seconds: float) -> None:
        """Record one answered request."""
        self.labelled(self.requests, endpoint, route, str(status)).inc()
        self.labelled(self.request_latency, endpoint, route).observe(seconds)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


class _BreakerCollector(Collector):
    """`chatroute_breaker_state{provider, state}`: 1 for each provider's current state."""

    def __init__(self, breakers: CircuitBreakerRegistry) -> None:
        self._breakers = breakers

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "chatroute_breaker_state",
            "Circuit breaker state per provider: 1 for the current state, 0 for the others.",
            labels=["provider", "state"],
        )
        failures = GaugeMetricFamily(
            "chatroute_breaker_window_failure_rate",
            "Share of failed attempts in each provider's breaker window (0 when empty).",
            labels=["provider"],
        )
        for breaker in self._breakers:
            snapshot = breaker.snapshot()
            for state in BreakerState:
                family.add_metric(
                    [breaker.name, state.value], 1.0 if snapshot.state is state else 0.0
                )
            failures.add_metric([breaker.name], snapshot.failure_rate)
        yield family
        yield failures

    def describe(self) -> Iterator[Metric]:
        return iter(())
