"""Health-aware failover: per-provider circuit breakers, error classes, Retry-After, deadlines."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from chatroute.chat.client import ChatClient
from chatroute.errors import FailureKind, FailurePolicy, classify_failure, is_cancelling
from chatroute.failover.attempt import FailoverChatClientAttempt
from chatroute.failover.base import FailoverChatClient
from chatroute.failover.breaker import (
    BreakerPermit,
    BreakerSettings,
    CircuitBreaker,
    CircuitBreakerRegistry,
    PermitKind,
)
from chatroute.failover.timeouts import DeadlineExceededError
from chatroute.router.base import close_each_once, snapshot_clients
from chatroute.router.context import RoutingContext

__all__ = ["HealthAwareFailoverChatClient", "Selection"]

_ref = weakref.ref
logger = logging.getLogger(__name__)


def _reason(failure: BaseException) -> str:
    """A failure in a few words for the log: its kind and HTTP status (no message text,
    which may quote what the caller sent)."""
    status = getattr(failure, "status_code", None)
    kind = classify_failure(failure).value
    return f"{kind}, HTTP {status}" if isinstance(status, int) else kind


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Selection:
    """One provider choice made for a request, readable while its attempt runs.

    - `provider`, `client`: what was chosen.
    - `attempt_number`: 1 for the request's first attempt, then 2, 3, ...
    - `probe`: the attempt is the half-open probe of the provider's breaker.
    - `forced_probe`: every remaining candidate's breaker refused, and this attempt was
      made anyway (at most once per request) rather than failing without trying.
    - `waited`: seconds spent waiting (Retry-After, retry backoff) before this attempt.
    """

    provider: str
    client: ChatClient
    attempt_number: int
    probe: bool
    forced_probe: bool
    waited: float


@dataclass(slots=True)
class _Candidate:
    position: int
    client: ChatClient
    name: str
    breaker: CircuitBreaker
    context_window: int | None


@dataclass(slots=True, eq=False)
class _RequestState:
    deadline_at: float | None
    tries: dict[str, int] = field(default_factory=dict)
    extra_tries: dict[str, int] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)
    not_before: dict[str, float] = field(default_factory=dict)
    min_context: int | None = None
    forced_probe_used: bool = False
    attempts: int = 0
    permit: BreakerPermit | None = None
    selection: Selection | None = None
    last_failure: BaseException | None = None


def _policy_of(failure: BaseException) -> FailurePolicy:
    """The error-class row for a failure (`chatroute.errors` owns the table)."""
    kind = classify_failure(failure)
    if kind is FailureKind.CANCELLED:
        # A CancelledError that a client raised while the caller was not cancelling is an
        # ordinary failure (routing contract C2): fail over, but it says nothing about the
        # provider's health.
        return FailurePolicy(fail_over=True, retry_same_provider=True, counts_against_health=False)
    return kind.policy


_PROBE = PermitKind.PROBE  # read per selection: a global is cheaper than the enum's member


def _seconds(name: str, value: object, *, allow_none: bool, allow_zero: bool) -> float | None:
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must not be None")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}")
    return number


def _retry_hint(failure: BaseException) -> float | None:
    """The failure's Retry-After hint in seconds, when it carries a usable one."""
    value = getattr(failure, "retry_after", None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if math.isnan(value) or value < 0:
        return None
    return float(value)


def _window(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int token count, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be a positive token count, got {value}")
    return value


class HealthAwareFailoverChatClient(FailoverChatClient):
    """Fails over across providers in configured order, skipping the ones that are down.

    Selection takes the candidates in order and skips providers already tried in this
    request (unless `retry_same_client` is set, in which case each provider gets up to
    `max_tries_per_client` tries, least-tried first, `retry_backoff` seconds apart), those
    excluded by an earlier failure of the request, and those whose circuit breaker is
    open. When every remaining candidate is refused by its breaker, one forced probe
    attempt is made (at most once per request; `current_selection(context).forced_probe`
    says so) rather than failing without trying.

    The routing update feeds each attempt's outcome to the provider's breaker and acts on
    the failure's class (`chatroute.providers.errors.classify`):

    - connect errors, 5xx, 408, timeouts, broken or malformed streams: fail over;
    - 429: fail over; with a Retry-After of at most `retry_after_max` seconds that fits the
      request deadline, the provider may be tried once more, but not before that time
      (selection waits for it only when no other candidate is ready);
    - first-token timeout: fail over, never the same provider again in this request;
    - 401 / 403 / 404: fail over and trip the provider's breaker (unhealthy);
    - 400 context length: fail over only to a provider whose declared context window is
      larger, otherwise stop with the error;
    - other 4xx: stop and return the error as is;
    - a failure while the caller is cancelling, or a caller that stops a stream: never
      counted against the provider.

    `request_deadline` (seconds from the request's first selection) is checked before each
    new attempt: when no time is left, `DeadlineExceededError` is raised (its cause is the
    last failure). It does not interrupt a running attempt: bound those with
    `TimeoutChatClient` or the provider's own timeouts. When the candidates run out, the
    last failure is re-raised. `maximum_attempts_per_request` is the attempt budget.

    Providers are named by `names` (a sequence parallel to `clients`, or a mapping from
    client to name), else by the client's `name` attribute, else by class and position.
    Breakers are per provider name; pass `breaker_factory` (for example
    `CircuitBreakerRegistry.get`) to share them between routers, or `breaker_settings` to
    configure private ones. Context windows come from `context_windows` (by provider name)
    or the client's `context_window` attribute. `clock` and `sleep` can be replaced in
    tests. `aclose()` closes each distinct client once unless `leave_open` is set.
    """

    def __init__(
        self,
        clients: Iterable[ChatClient],
        *,
        names: Sequence[str] | Mapping[ChatClient, str] | None = None,
        breaker_settings: BreakerSettings | None = None,
        breaker_factory: Callable[[str], CircuitBreaker] | None = None,
        retry_same_client: bool = False,
        max_tries_per_client: int = 2,
        retry_backoff: float = 0.0,
        retry_after_max: float = 5.0,
        request_deadline: float | None = None,
        context_windows: Mapping[str, int] | None = None,
        maximum_attempts_per_request: int | None = None,
        leave_open: bool = False,
        clock: Clock | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        snapshot = snapshot_clients(clients)
        for flag_name, flag in (
            ("retry_same_client", retry_same_client),
            ("leave_open", leave_open),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
        if isinstance(max_tries_per_client, bool) or not isinstance(max_tries_per_client, int):
            raise TypeError(
                f"max_tries_per_client must be an int, got {type(max_tries_per_client).__name__}"
            )
        if max_tries_per_client < 1:
            raise ValueError(f"max_tries_per_client must be at least 1, got {max_tries_per_client}")
        if breaker_settings is not None and breaker_factory is not None:
            raise ValueError("pass breaker_settings or breaker_factory, not both")
        if breaker_factory is not None and not callable(breaker_factory):
            raise TypeError("breaker_factory must be callable")
        if clock is not None and not callable(clock):
            raise TypeError("clock must be callable")
        if sleep is not None and not callable(sleep):
            raise TypeError("sleep must be callable")
        self._clock: Clock = clock if clock is not None else time.monotonic
        self._sleep: Sleep = sleep if sleep is not None else asyncio.sleep
        self._retry_backoff: float = (
            _seconds("retry_backoff", retry_backoff, allow_none=False, allow_zero=True) or 0.0
        )
        self._retry_after_max: float = (
            _seconds("retry_after_max", retry_after_max, allow_none=False, allow_zero=True) or 0.0
        )
        self._request_deadline = _seconds(
            "request_deadline", request_deadline, allow_none=True, allow_zero=False
        )
        if request_deadline is not None and math.isinf(float(request_deadline)):
            self._request_deadline = None
        self.maximum_attempts_per_request = maximum_attempts_per_request

        provider_names = self._resolve_names(snapshot, names)
        if context_windows is not None and not isinstance(context_windows, Mapping):
            raise TypeError(
                f"context_windows must be a mapping of provider name to tokens, "
                f"got {type(context_windows).__name__}"
            )
        windows = dict(context_windows or {})
        unknown = set(windows) - set(provider_names)
        if unknown:
            raise ValueError(f"context_windows names unknown providers: {sorted(unknown)}")
        factory = breaker_factory
        if factory is None:
            factory = CircuitBreakerRegistry(breaker_settings, clock=self._clock).get
        breakers: dict[str, CircuitBreaker] = {}
        candidates: list[_Candidate] = []
        for position, (client, name) in enumerate(zip(snapshot, provider_names, strict=True)):
            breaker = breakers.get(name)
            if breaker is None:
                breaker = factory(name)
                if not isinstance(breaker, CircuitBreaker):
                    raise TypeError(
                        f"breaker_factory returned {type(breaker).__name__}, not a CircuitBreaker"
                    )
                breakers[name] = breaker
            window = _window(f"context_windows[{name!r}]", windows.get(name))
            if window is None:
                declared = getattr(client, "context_window", None)
                if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
                    window = declared
            candidates.append(_Candidate(position, client, name, breaker, window))
        self._clients = snapshot
        self._candidates = tuple(candidates)
        self._breakers = breakers
        self._names_by_id = {id(c.client): c.name for c in candidates}
        self._retry_same_client = retry_same_client
        self._max_tries = max_tries_per_client if retry_same_client else 1
        self._leave_open = leave_open
        # Per-request state, keyed weakly by the request's RoutingContext: what a
        # WeakKeyDictionary does, with its operations written inline (they run several
        # times a request). A context that dies with state still held takes it along.
        states: dict[weakref.ref[RoutingContext], _RequestState] = {}

        def discard(key: weakref.ref[RoutingContext]) -> None:
            states.pop(key, None)

        self._states = states
        self._discard = discard
        self._closed = False

    # -- construction helpers ----------------------------------------------------------

    @staticmethod
    def _resolve_names(
        clients: tuple[ChatClient, ...], names: Sequence[str] | Mapping[ChatClient, str] | None
    ) -> list[str]:
        given: dict[int, str] = {}
        if names is None:
            pass
        elif isinstance(names, Mapping):
            for client, label in names.items():
                given[id(client)] = label
        elif isinstance(names, str | bytes) or not isinstance(names, Sequence):
            raise TypeError(
                f"names must be a sequence of str or a mapping of client to str, "
                f"got {type(names).__name__}"
            )
        else:
            if len(names) != len(clients):
                raise ValueError(
                    f"names has {len(names)} entries but there are {len(clients)} clients"
                )
        resolved: list[str] = []
        first_name: dict[int, str] = {}
        for position, client in enumerate(clients):
            if isinstance(names, Sequence) and not isinstance(names, str | bytes):
                name: object = names[position]
            elif id(client) in given:
                name = given[id(client)]
            elif id(client) in first_name:
                name = first_name[id(client)]
            else:
                attr = getattr(client, "name", None)
                name = (
                    attr
                    if isinstance(attr, str) and attr
                    else f"{type(client).__name__}#{position}"
                )
            if not isinstance(name, str):
                raise TypeError(
                    f"the name of clients[{position}] must be a str, got {type(name).__name__}"
                )
            if not name:
                raise ValueError(f"the name of clients[{position}] must not be empty")
            first_name.setdefault(id(client), name)
            resolved.append(name)
        return resolved

    # -- observation -------------------------------------------------------------------

    @property
    def clients(self) -> tuple[ChatClient, ...]:
        """The clients in configured order (a snapshot taken at construction)."""
        return self._clients

    @property
    def provider_names(self) -> tuple[str, ...]:
        """The provider name of each client, in configured order."""
        return tuple(c.name for c in self._candidates)

    @property
    def breakers(self) -> Mapping[str, CircuitBreaker]:
        """The breaker of each provider, by name."""
        return dict(self._breakers)

    @property
    def leave_open(self) -> bool:
        """Whether `aclose()` leaves the clients open."""
        return self._leave_open

    @property
    def request_deadline(self) -> float | None:
        """Seconds a request may spend from its first selection until its last attempt starts."""
        return self._request_deadline

    def provider_name(self, client: ChatClient) -> str:
        """The provider name of one of this router's clients (by identity)."""
        try:
            return self._names_by_id[id(client)]
        except KeyError:
            raise ValueError("client is not one of this router's clients") from None

    def current_selection(self, context: RoutingContext) -> Selection | None:
        """The latest selection of the request running with `context`, if it is still running.

        Read it from an overriding `select_client` after calling `super()`, or from an
        overriding `on_routing_update` before calling `super()`: the request's state is
        released when its terminal update has been handled.
        """
        state = self._states.get(_ref(context))
        return state.selection if state is not None else None

    def active_requests(self) -> int:
        """How many requests currently hold per-request state."""
        return len(self._states)

    # -- selection ---------------------------------------------------------------------

    def _eligible(self, state: _RequestState) -> list[_Candidate]:
        result = []
        for candidate in self._candidates:
            name = candidate.name
            if name in state.excluded:
                continue
            if state.tries.get(name, 0) >= self._max_tries + state.extra_tries.get(name, 0):
                continue
            if state.min_context is not None and (
                candidate.context_window is None or candidate.context_window <= state.min_context
            ):
                continue
            result.append(candidate)
        result.sort(key=lambda c: state.tries.get(c.name, 0))  # stable: configured order kept
        return result

    def _raise_exhausted(self, context: RoutingContext, state: _RequestState) -> None:
        self._states.pop(_ref(context), None)
        failure = state.last_failure
        if failure is None:  # unreachable: the first selection always has a candidate
            raise RuntimeError("no provider is available for this request")
        raise failure

    async def select_client(self, context: RoutingContext) -> ChatClient:
        """The first usable candidate; waits for Retry-After/backoff when nothing else is ready."""
        if context is None:
            raise TypeError("context must not be None")
        if not isinstance(context, RoutingContext):
            raise TypeError(f"context must be a RoutingContext, got {type(context).__name__}")
        state = self._states.get(_ref(context))
        try:
            if state is None:
                deadline = self._request_deadline
                state = _RequestState(None if deadline is None else self._clock() + deadline)
                self._states[_ref(context, self._discard)] = state
                # A request's first selection: nothing is excluded, waited for or tried
                # yet, and the deadline has just started, so the first candidate whose
                # breaker grants a permit is the choice. When every breaker refuses,
                # `_choose` decides.
                for candidate in self._candidates:
                    permit = candidate.breaker.try_acquire()
                    if permit is not None:
                        return self._chosen(state, candidate, permit, False, 0.0)
            return await self._choose(state)
        except BaseException:
            self._states.pop(_ref(context), None)
            raise

    async def _choose(self, state: _RequestState) -> ChatClient:
        waited = 0.0
        while True:
            now = self._clock()
            if state.deadline_at is not None and now >= state.deadline_at:
                budget = self._request_deadline or 0.0
                raise DeadlineExceededError(
                    budget,
                    f"the request deadline of {budget:g} s was exceeded "
                    f"after {state.attempts} attempt(s)",
                ) from state.last_failure
            eligible = self._eligible(state)
            if not eligible:
                failure = state.last_failure
                if failure is None:
                    raise RuntimeError("no provider is available for this request")
                raise failure
            ready = [c for c in eligible if state.not_before.get(c.name, now) <= now]
            for candidate in ready:
                permit = candidate.breaker.try_acquire()
                if permit is not None:
                    return self._chosen(state, candidate, permit, False, waited)
            waits = [
                state.not_before[c.name]
                for c in eligible
                if state.not_before.get(c.name, now) > now
                and (state.deadline_at is None or state.not_before[c.name] < state.deadline_at)
            ]
            if waits:
                wake = min(waits)
                await self._sleep(wake - now)
                waited += max(0.0, self._clock() - now)
                continue
            if ready and not state.forced_probe_used:
                candidate = ready[0]
                state.forced_probe_used = True
                return self._chosen(
                    state, candidate, candidate.breaker.force_acquire(), True, waited
                )
            failure = state.last_failure
            if failure is None:
                raise RuntimeError("no provider is available for this request")
            raise failure

    def _chosen(
        self,
        state: _RequestState,
        candidate: _Candidate,
        permit: BreakerPermit,
        forced: bool,
        waited: float,
    ) -> ChatClient:
        name = candidate.name
        state.attempts += 1
        state.tries[name] = state.tries.get(name, 0) + 1
        state.not_before.pop(name, None)
        state.permit = permit
        # Positional: a frozen dataclass takes its keyword arguments at twice the cost.
        state.selection = selection = Selection(
            name, candidate.client, state.attempts, permit.kind is _PROBE, forced, waited
        )
        self.selected(selection)
        return candidate.client

    # -- observation -------------------------------------------------------------------

    def selected(self, selection: Selection) -> None:
        """Called, in the request's task, as each provider is chosen; does nothing here.

        Override to observe selections without wrapping `select_client`: cheaper than an
        async override on every request, and `selection` carries the choice's flags.
        """

    def attempted(
        self,
        selection: Selection | None,
        attempt: FailoverChatClientAttempt,
        is_terminal: bool,
    ) -> None:
        """Called, in the request's task, as each attempt is reported (before the policy
        acts on it); does nothing here. `selection` is the attempt's selection (None when
        the update is not for a request this router is running)."""

    # -- feedback ----------------------------------------------------------------------

    def _candidate_for(
        self, state: _RequestState | None, attempt: FailoverChatClientAttempt
    ) -> _Candidate | None:
        if (
            state is not None
            and state.selection is not None
            and state.selection.client is attempt.client
        ):
            name = state.selection.provider
        else:
            found = self._names_by_id.get(id(attempt.client))
            if found is None:
                return None
            name = found
        for candidate in self._candidates:
            if candidate.name == name:
                return candidate
        return None

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        """Feed the attempt to the provider's breaker, then plan the request's next attempt.

        Raises the attempt's failure when the request must stop (a 4xx to return as is, a
        context-length error with no larger candidate, or no candidate left).
        """
        if context is None:
            raise TypeError("context must not be None")
        state = self._states.get(_ref(context))
        self.attempted(state.selection if state is not None else None, attempt, is_terminal)
        permit = None
        if state is not None:
            permit, state.permit = state.permit, None
        failure = attempt.exception

        if failure is None:
            # A completed response, or a caller that stopped a stream after output: the
            # provider delivered.
            if permit is not None:
                permit.record_success()
            self._states.pop(_ref(context), None)
            return
        if is_terminal and is_cancelling():
            if permit is not None:
                permit.release()  # the caller left: not the provider's fault
            self._states.pop(_ref(context), None)
            return

        candidate = self._candidate_for(state, attempt)
        policy = _policy_of(failure)
        if permit is not None:
            if policy.counts_against_health:
                permit.record_failure()
            else:
                permit.release()
        if policy.mark_unhealthy and candidate is not None:
            candidate.breaker.trip(reason=_reason(failure))
        if is_terminal:
            self._states.pop(_ref(context), None)
            return
        if state is None:
            # Not a request this router is running (its state was discarded by aclose(), or
            # the hook was called directly): stop rather than start the request over.
            raise failure

        state.last_failure = failure
        if policy.return_to_caller and not policy.needs_larger_context:
            self._states.pop(_ref(context), None)
            raise failure
        if candidate is not None:
            name = candidate.name
            if policy.needs_larger_context:
                state.excluded.add(name)
                window = candidate.context_window
                if window is None:
                    self._states.pop(_ref(context), None)
                    raise failure  # nothing is known to be larger than an unknown window
                state.min_context = max(window, state.min_context or 0)
            elif not policy.retry_same_provider or not policy.fail_over:
                state.excluded.add(name)
            else:
                now = self._clock()
                retry_after = _retry_hint(failure) if policy.honour_retry_after else None
                if retry_after is not None:
                    wake = now + retry_after
                    if retry_after <= self._retry_after_max and (
                        state.deadline_at is None or wake < state.deadline_at
                    ):
                        # Honoured: one more try of this provider, not before it said.
                        state.extra_tries.setdefault(name, 1)
                        state.not_before[name] = wake
                    else:
                        state.excluded.add(name)  # the hint does not fit: fail over now
                elif self._retry_same_client and self._retry_backoff > 0:
                    state.not_before[name] = now + self._retry_backoff
        if not self._eligible(state):
            self._raise_exhausted(context, state)
        logger.warning(
            "provider %s failed (%s): failing over",
            candidate.name if candidate is not None else type(attempt.client).__name__,
            _reason(failure),
        )

    # -- lifetime ----------------------------------------------------------------------

    async def aclose(self) -> None:
        """Discard all state and close each distinct client once, unless `leave_open` is set.

        Idempotent. If a client's `aclose()` fails, the others are still closed and the
        first failure is re-raised afterwards.
        """
        self._states.clear()
        if self._closed:
            return
        self._closed = True
        if self._leave_open:
            return
        await close_each_once(self._clients)
