"""Per-request traces of route choice and failover attempts, recorded through a context variable."""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chatroute.chat.client import ChatClient
from chatroute.chat.types import UsageDetails
from chatroute.errors import classify_failure, is_cancelling
from chatroute.failover import FailoverChatClient, FailoverChatClientAttempt
from chatroute.failover.health import HealthAwareFailoverChatClient, Selection
from chatroute.router.context import RoutingContext

__all__ = [
    "AttemptRecord",
    "RecordingFailoverChatClient",
    "RequestTrace",
    "TraceRecorder",
    "current_trace",
    "end_trace",
    "note_upstream_request_id",
    "start_trace",
]


@dataclass(frozen=True)
class AttemptRecord:
    """One finished attempt: the route and provider it ran on, and the library's record.

    `cancelled` is true when the attempt ended because the caller went away, cancelled or
    ran out of its deadline (never the provider's fault). `probe` / `forced_probe` say the
    attempt was a circuit breaker's half-open probe, or the one attempt made although
    every candidate's breaker was open; `waited` is the time spent waiting (Retry-After,
    retry backoff) before the attempt started.
    """

    route: str
    provider: str
    attempt: FailoverChatClientAttempt
    is_terminal: bool
    cancelled: bool = False
    probe: bool = False
    forced_probe: bool = False
    waited: float = 0.0

    @property
    def outcome(self) -> str:
        """success, cancelled (by the caller), stopped (by the caller after output),
        failed (before output) or failed_after_output."""
        attempt = self.attempt
        if attempt.response_completed:
            return "success"
        if self.cancelled:
            return "cancelled"
        if attempt.exception is None:
            return "stopped"
        return "failed_after_output" if attempt.output_committed else "failed"

    @property
    def failure_kind(self) -> str | None:
        """The failure class of the attempt's exception (`FailureKind` value), if it failed."""
        if self.attempt.exception is None:
            return None
        return classify_failure(self.attempt.exception).value


@dataclass
class RequestTrace:
    """What one request did: the route, each provider selection and each finished attempt.

    A selection is recorded as soon as a provider is chosen, so while a stream is running
    its provider is known although its attempt record arrives only when the stream ends.
    The server fills in `status` (the HTTP status answered, 499 when the caller left
    first), `cancelled` ("disconnect" or "deadline" when the request was cut short by its
    caller's side), `committed` (whether output reached the caller), the answer's `usage`
    and `response_model` when the provider reported them and, for a stream,
    `first_output_at` (the `time.perf_counter()` reading when its first output arrived).
    A provider notes `upstream_request_id`, the id the upstream gave the call that answers.
    """

    route: str | None = None
    selections: list[tuple[str, str]] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)
    status: int | None = None
    cancelled: str | None = None
    committed: bool = False
    stream: bool = False
    usage: UsageDetails | None = None
    first_output_at: float | None = None
    response_model: str | None = None
    upstream_request_id: str | None = None  # the answering upstream's own id for the call

    @property
    def attempt_count(self) -> int:
        """Attempts started so far (the running one included)."""
        return len(self.selections)

    @property
    def provider(self) -> str | None:
        """The provider of the latest attempt: the one that served, once a request succeeded."""
        return self.selections[-1][1] if self.selections else None

    @property
    def failovers(self) -> int:
        """How many times the request moved to another provider."""
        return max(0, len(self.selections) - 1)


# The context variable holds a weak reference: callbacks scheduled during a request (a
# pooled connection's reader, a keep-alive timer) copy the context and may outlive the
# request by far; they must not keep its trace, attempts and exceptions alive.
_current: contextvars.ContextVar[weakref.ref[RequestTrace] | None] = contextvars.ContextVar(
    "chatroute_request_trace", default=None
)


def start_trace(route: str | None = None) -> RequestTrace:
    """Begin a trace for the request running in the current context and return it.

    The context refers to the trace weakly: keep the returned object for as long as the
    request runs.
    """
    trace = RequestTrace(route=route)
    _current.set(weakref.ref(trace))
    return trace


def end_trace() -> None:
    """Detach the current context from its trace."""
    _current.set(None)


def current_trace() -> RequestTrace | None:
    """The trace of the request running in the current context, if one was started."""
    ref = _current.get()
    return ref() if ref is not None else None


def note_upstream_request_id(value: str | None) -> None:
    """Record the id an upstream gave the call that answers, on the current request's trace
    if one was started: each attempt clears it as it starts (None) and sets it when the
    upstream accepts the call."""
    trace = current_trace()
    if trace is not None:
        trace.upstream_request_id = value


class TraceRecorder(FailoverChatClient):
    """Mix into any `FailoverChatClient` subclass to report to the current `RequestTrace`.

    Put it first among the bases (`class X(TraceRecorder, SomeFailoverChatClient)`): it
    records each selection and each attempt, then defers to the policy. It changes no
    decision; when no trace was started (offline use) it records nothing. Subclasses set
    `route` and may override `trace_provider_name`.
    """

    route: str = ""

    def trace_provider_name(self, client: ChatClient) -> str:
        """The name reported for `client` (its `name` attribute, else its class name)."""
        name = getattr(client, "name", None)
        return name if isinstance(name, str) and name else type(client).__name__

    def _selection_flags(self, context: RoutingContext) -> tuple[bool, bool, float]:
        if isinstance(self, HealthAwareFailoverChatClient):
            selection = self.current_selection(context)
            if selection is not None:
                return selection.probe, selection.forced_probe, selection.waited
        return False, False, 0.0

    async def select_client(self, context: RoutingContext) -> ChatClient:
        # A mixin: the policy that follows in the MRO implements select_client.
        client = await super().select_client(context)  # type: ignore[safe-super]
        trace = current_trace()
        if trace is not None and client is not None:
            trace.selections.append((self.route, self.trace_provider_name(client)))
        return client

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        trace = current_trace()
        if trace is not None:
            probe, forced, waited = self._selection_flags(context)
            _record_attempt(
                trace,
                self.route,
                self.trace_provider_name(attempt.client),
                attempt,
                is_terminal,
                probe,
                forced,
                waited,
            )
        await super().on_routing_update(context, attempt, is_terminal)


def _record_attempt(
    trace: RequestTrace,
    route: str,
    provider: str,
    attempt: FailoverChatClientAttempt,
    is_terminal: bool,
    probe: bool,
    forced: bool,
    waited: float,
) -> None:
    caller_side = (attempt.exception is not None and is_cancelling()) or (
        trace.cancelled is not None and not attempt.response_completed
    )
    # Positional: a frozen dataclass takes its keyword arguments at twice the cost.
    cancelled = is_terminal and caller_side
    trace.attempts.append(
        AttemptRecord(route, provider, attempt, is_terminal, cancelled, probe, forced, waited)
    )


class RecordingFailoverChatClient(TraceRecorder, HealthAwareFailoverChatClient):
    """A route's failover chain: health-aware failover that reports to the current trace.

    It records through the health-aware client's `selected` / `attempted` hooks rather
    than TraceRecorder's wrapping of `select_client` and `on_routing_update` (the same
    records, one coroutine layer and one state lookup fewer per call).

    It behaves exactly like `HealthAwareFailoverChatClient` (breakers, error classes,
    Retry-After, attempt budget, request deadline); `provider_names` names each client
    (a mapping by client, or a sequence parallel to `clients`), which is also the name
    its breaker is kept under. Pass `breaker_factory=registry.get` so every route shares
    one breaker per provider. Other keyword arguments go to the health-aware client.
    """

    def __init__(
        self,
        route: str,
        clients: Iterable[ChatClient],
        provider_names: Mapping[ChatClient, str] | Sequence[str],
        *,
        leave_open: bool = False,
        **health: Any,
    ) -> None:
        snapshot = tuple(clients)
        if isinstance(provider_names, Mapping):
            given = {id(client): name for client, name in provider_names.items()}
            names = [
                given.get(id(client), f"{type(client).__name__}#{i}")
                for i, client in enumerate(snapshot)
            ]
        else:
            names = list(provider_names)
        super().__init__(snapshot, names=names, leave_open=leave_open, **health)
        self.route = route

    def trace_provider_name(self, client: ChatClient) -> str:
        try:
            return self.provider_name(client)
        except ValueError:
            return super().trace_provider_name(client)

    # The policy's own methods, not TraceRecorder's wrappers: the hooks below record.
    select_client = HealthAwareFailoverChatClient.select_client
    on_routing_update = HealthAwareFailoverChatClient.on_routing_update

    def selected(self, selection: Selection) -> None:
        trace = current_trace()
        if trace is not None:
            trace.selections.append((self.route, selection.provider))

    def attempted(
        self,
        selection: Selection | None,
        attempt: FailoverChatClientAttempt,
        is_terminal: bool,
    ) -> None:
        trace = current_trace()
        if trace is None:
            return
        if selection is None:
            probe, forced, waited = False, False, 0.0
            provider = self.trace_provider_name(attempt.client)
        else:
            probe, forced, waited = selection.probe, selection.forced_probe, selection.waited
            provider = (
                selection.provider
                if selection.client is attempt.client
                else self.trace_provider_name(attempt.client)
            )
        _record_attempt(trace, self.route, provider, attempt, is_terminal, probe, forced, waited)


TraceSink = Callable[[RequestTrace], None]
