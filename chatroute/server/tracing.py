"""Per-request traces of route choice and failover attempts, recorded through a context variable."""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chatroute.chat.client import ChatClient
from chatroute.failover import FailoverChatClientAttempt, OrderedFailoverChatClient
from chatroute.router.context import RoutingContext

__all__ = [
    "AttemptRecord",
    "RecordingFailoverChatClient",
    "RequestTrace",
    "current_trace",
    "start_trace",
]


@dataclass(frozen=True)
class AttemptRecord:
    """One finished attempt: the route and provider it ran on, and the library's record."""

    route: str
    provider: str
    attempt: FailoverChatClientAttempt
    is_terminal: bool

    @property
    def outcome(self) -> str:
        """One of success, failed (before output), failed_after_output, stopped (by the caller)."""
        attempt = self.attempt
        if attempt.response_completed:
            return "success"
        if attempt.exception is None:
            return "stopped"
        return "failed_after_output" if attempt.output_committed else "failed"


@dataclass
class RequestTrace:
    """What one request did: the route, each provider selection and each finished attempt.

    A selection is recorded as soon as a provider is chosen, so while a stream is running
    its provider is known although its attempt record arrives only when the stream ends.
    """

    route: str | None = None
    selections: list[tuple[str, str]] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)

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


_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "chatroute_request_trace", default=None
)


def start_trace(route: str | None = None) -> RequestTrace:
    """Begin a trace for the request running in the current context and return it."""
    trace = RequestTrace(route=route)
    _current.set(trace)
    return trace


def current_trace() -> RequestTrace | None:
    """The trace of the request running in the current context, if one was started."""
    return _current.get()


class RecordingFailoverChatClient(OrderedFailoverChatClient):
    """An ordered failover chain that reports selections and attempts to the current trace.

    It behaves exactly like `OrderedFailoverChatClient`; when no trace was started (as in
    offline use) it records nothing. `provider_names` maps each client (by identity) to the
    name reported for it.
    """

    def __init__(
        self,
        route: str,
        clients: Iterable[ChatClient],
        provider_names: Mapping[ChatClient, str],
        *,
        leave_open: bool = False,
    ) -> None:
        super().__init__(clients, leave_open=leave_open)
        self.route = route
        self._names = {id(client): name for client, name in provider_names.items()}

    def provider_name(self, client: ChatClient) -> str:
        """The configured name of `client` (its class name when it has none)."""
        return self._names.get(id(client), type(client).__name__)

    async def select_client(self, context: RoutingContext) -> ChatClient:
        client = await super().select_client(context)
        trace = _current.get()
        if trace is not None:
            trace.selections.append((self.route, self.provider_name(client)))
        return client

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        trace = _current.get()
        if trace is not None:
            record = AttemptRecord(
                self.route, self.provider_name(attempt.client), attempt, is_terminal
            )
            trace.attempts.append(record)
        await super().on_routing_update(context, attempt, is_terminal)
