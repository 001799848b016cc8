"""Per-provider circuit breakers: failure rate over a sliding window, cool-down, single probe."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = [
    "BreakerListener",
    "BreakerPermit",
    "BreakerSettings",
    "BreakerSnapshot",
    "BreakerState",
    "CircuitBreaker",
    "CircuitBreakerRegistry",
    "PermitKind",
]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
BreakerListener = Callable[[str, "BreakerState", "BreakerState"], None]


class BreakerState(enum.Enum):
    """Where a breaker stands: passing traffic, refusing it, or letting one probe through."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class PermitKind(enum.Enum):
    """Why a call was let through: normal traffic, the half-open probe, or a forced probe."""

    NORMAL = "normal"
    PROBE = "probe"
    FORCED = "forced"


# The members the per-call paths compare with, as module names: on Python 3.11 reading an
# enum member off its class costs about ten times reading a global.
_CLOSED = BreakerState.CLOSED
_OPEN = BreakerState.OPEN
_NORMAL = PermitKind.NORMAL


def _seconds(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or math.isinf(number) or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """How a breaker decides.

    - `failure_rate_threshold`: the breaker opens when the share of failures among the
      outcomes recorded in the last `window` seconds reaches this value (0 < x <= 1) ...
    - `minimum_requests`: ... and at least this many outcomes were recorded in the window.
    - `window`: the length of the sliding window, in seconds.
    - `cool_down`: how long an open breaker refuses traffic before it lets one probe through.
    """

    failure_rate_threshold: float = 0.5
    minimum_requests: int = 5
    window: float = 30.0
    cool_down: float = 15.0

    def __post_init__(self) -> None:
        rate = self.failure_rate_threshold
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise TypeError(f"failure_rate_threshold must be a number, got {type(rate).__name__}")
        if math.isnan(rate) or not 0 < rate <= 1:
            raise ValueError(f"failure_rate_threshold must be in (0, 1], got {rate!r}")
        count = self.minimum_requests
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"minimum_requests must be an int, got {type(count).__name__}")
        if count < 1:
            raise ValueError(f"minimum_requests must be at least 1, got {count}")
        _seconds("window", self.window, positive=True)
        _seconds("cool_down", self.cool_down, positive=False)


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """A breaker's state and the outcomes currently in its window."""

    name: str
    state: BreakerState
    successes: int
    failures: int
    probe_in_flight: bool
    opened_at: float | None

    @property
    def total(self) -> int:
        """Outcomes in the window."""
        return self.successes + self.failures

    @property
    def failure_rate(self) -> float:
        """Failures over outcomes in the window (0.0 when the window is empty)."""
        return self.failures / self.total if self.total else 0.0


class BreakerPermit:
    """Leave to make one call through a breaker; settle it once with the call's outcome.

    Settling more than once has no further effect. A permit is tied to the breaker state it
    was granted in: if the breaker has changed state since, its outcome is ignored. A probe
    permit that is dropped without being settled frees the probe slot when it is
    garbage-collected, so an abandoned request cannot keep a provider half-open forever.
    """

    __slots__ = ("__weakref__", "_breaker", "_generation", "_settled", "kind")

    def __init__(self, breaker: CircuitBreaker, kind: PermitKind, generation: int) -> None:
        self._breaker = breaker
        self.kind = kind
        self._generation = generation
        self._settled = False

    @property
    def breaker(self) -> CircuitBreaker:
        """The breaker that granted this permit."""
        return self._breaker

    @property
    def settled(self) -> bool:
        """Whether an outcome (or a release) was already reported."""
        return self._settled

    def record_success(self) -> None:
        """The call succeeded."""
        if not self._settled:
            self._settled = True
            self._breaker._settle(self, True)

    def record_failure(self) -> None:
        """The call failed in a way that counts against the provider."""
        if not self._settled:
            self._settled = True
            self._breaker._settle(self, False)

    def release(self) -> None:
        """The call ended without a verdict on the provider (for example, the caller left)."""
        if not self._settled:
            self._settled = True
            self._breaker._settle(self, None)

    def __repr__(self) -> str:
        return f"<BreakerPermit {self._breaker.name!r} {self.kind.value} settled={self._settled}>"


class CircuitBreaker:
    """The health of one provider, as seen by the calls made to it.

    Closed, it lets every call through and records outcomes in a sliding time window; once
    the window holds at least `minimum_requests` outcomes and the failure share reaches
    `failure_rate_threshold`, it opens. Open, it refuses calls for `cool_down` seconds,
    then becomes half-open and lets exactly one probe through at a time: a successful
    probe closes it (with an empty window), a failed one opens it again. `trip()` opens
    it at once (a provider known to be unusable, such as one that rejects its key).

    Time comes from `clock` (default `time.monotonic`), so tests can drive it. The open to
    half-open move happens when the breaker is next consulted after the cool-down. Every
    transition is reported to the listeners as `fn(name, old_state, new_state)`; a listener
    that raises is logged and otherwise ignored. Not thread-safe: use it from one event loop.
    """

    def __init__(
        self,
        name: str,
        settings: BreakerSettings | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        if name is None:
            raise TypeError("name must not be None")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if settings is None:
            settings = BreakerSettings()
        elif not isinstance(settings, BreakerSettings):
            raise TypeError(f"settings must be BreakerSettings, got {type(settings).__name__}")
        if clock is not None and not callable(clock):
            raise TypeError("clock must be callable")
        self._name = name
        self._settings = settings
        self._clock: Clock = clock if clock is not None else time.monotonic
        self._state = BreakerState.CLOSED
        self._generation = 0
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._failures = 0
        self._opened_at: float | None = None
        self._probe: weakref.ref[BreakerPermit] | None = None
        self._listeners: list[BreakerListener] = []

    # -- observation -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The provider this breaker guards."""
        return self._name

    @property
    def settings(self) -> BreakerSettings:
        """The thresholds this breaker uses."""
        return self._settings

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose cool-down has passed reads half-open)."""
        self._refresh(self._clock())
        return self._state

    @property
    def probe_in_flight(self) -> bool:
        """Whether a probe permit is out and not yet settled."""
        return self._live_probe() is not None

    def snapshot(self) -> BreakerSnapshot:
        """The state and window counts, after expiring outcomes older than the window."""
        now = self._clock()
        self._refresh(now)
        self._prune(now)
        total = len(self._outcomes)
        return BreakerSnapshot(
            name=self._name,
            state=self._state,
            successes=total - self._failures,
            failures=self._failures,
            probe_in_flight=self.probe_in_flight,
            opened_at=self._opened_at,
        )

    def remaining_cool_down(self) -> float:
        """Seconds until an open breaker lets a probe through; 0.0 when it is not open."""
        now = self._clock()
        self._refresh(now)
        if self._state is not BreakerState.OPEN or self._opened_at is None:
            return 0.0
        return max(0.0, self._opened_at + self._settings.cool_down - now)

    def add_listener(self, listener: BreakerListener) -> None:
        """Call `listener(name, old_state, new_state)` on every transition."""
        if listener is None:
            raise TypeError("listener must not be None")
        if not callable(listener):
            raise TypeError("listener must be callable")
        self._listeners.append(listener)

    def remove_listener(self, listener: BreakerListener) -> None:
        """Stop calling `listener`; raises ValueError if it was not added."""
        try:
            self._listeners.remove(listener)
        except ValueError:
            raise ValueError("listener was not added to this breaker") from None

    # -- permits -----------------------------------------------------------------------

    def try_acquire(self) -> BreakerPermit | None:
        """A permit for one call, or None when the breaker refuses it.

        Closed: a normal permit. Open within the cool-down: None. Half-open (or open with
        the cool-down passed): the probe permit if no probe is out, otherwise None.
        """
        if self._state is _CLOSED:  # only an open breaker changes with time
            return BreakerPermit(self, _NORMAL, self._generation)
        self._refresh(self._clock())
        if self._state is BreakerState.HALF_OPEN and self._live_probe() is None:
            permit = BreakerPermit(self, PermitKind.PROBE, self._generation)
            self._probe = weakref.ref(permit)
            return permit
        return None

    def force_acquire(self) -> BreakerPermit:
        """A permit whatever the state: the last-resort probe when every candidate is refused.

        On a closed breaker this is an ordinary permit. Otherwise its success closes the
        breaker and its failure (re)opens it with a fresh cool-down, provided the breaker
        has not changed state in the meantime.
        """
        permit = self.try_acquire()
        if permit is not None:
            return permit
        return BreakerPermit(self, PermitKind.FORCED, self._generation)

    # -- explicit transitions ---------------------------------------------------------

    def trip(self, remaining: float | None = None, *, reason: str = "tripped") -> None:
        """Open the breaker now (or restart its cool-down if it is open already).

        `remaining` shortens the cool-down to that many seconds from now (never beyond
        `cool_down`): a breaker opened elsewhere, such as by another replica, carries over
        the rest of that cool-down. `opened_at` then reads as the time it would have opened
        for that to be left.
        """
        if remaining is not None:
            if isinstance(remaining, bool) or not isinstance(remaining, int | float):
                raise TypeError(f"remaining must be a number, got {type(remaining).__name__}")
            if math.isnan(remaining) or remaining < 0:
                raise ValueError(f"remaining must be >= 0 seconds, got {remaining!r}")
        now = self._clock()
        self._refresh(now)
        cool_down = self._settings.cool_down
        if remaining is None or remaining >= cool_down:
            self._open(now, reason)
        else:
            self._open(now - (cool_down - remaining), reason)

    def reset(self, *, reason: str = "reset") -> None:
        """Close the breaker now, with an empty window."""
        self._refresh(self._clock())
        if self._state is not BreakerState.CLOSED:
            self._transition(BreakerState.CLOSED, reason)
        self._clear()

    # -- internals ---------------------------------------------------------------------

    def _live_probe(self) -> BreakerPermit | None:
        probe = self._probe() if self._probe is not None else None
        if probe is None or probe._settled or probe._generation != self._generation:
            self._probe = None
            return None
        return probe

    def _refresh(self, now: float) -> None:
        if (
            self._state is BreakerState.OPEN
            and self._opened_at is not None
            and now - self._opened_at >= self._settings.cool_down
        ):
            self._transition(
                BreakerState.HALF_OPEN, f"cool-down of {self._settings.cool_down:g} s elapsed"
            )

    def _prune(self, now: float) -> None:
        horizon = now - self._settings.window
        outcomes = self._outcomes
        while outcomes and outcomes[0][0] <= horizon:
            _, ok = outcomes.popleft()
            if not ok:
                self._failures -= 1

    def _clear(self) -> None:
        self._outcomes.clear()
        self._failures = 0

    def _open(self, now: float, reason: str) -> None:
        self._opened_at = now
        self._clear()
        if self._state is BreakerState.OPEN:
            self._generation += 1  # a restarted cool-down voids permits granted before it
        else:
            self._transition(BreakerState.OPEN, reason)

    def _transition(self, new_state: BreakerState, reason: str) -> None:
        old_state = self._state
        logger.warning(
            "circuit breaker of provider %s: %s -> %s (%s)",
            self._name,
            old_state.value,
            new_state.value,
            reason,
        )
        self._state = new_state
        self._generation += 1
        self._probe = None
        if new_state is BreakerState.CLOSED:
            self._opened_at = None
        for listener in tuple(self._listeners):
            try:
                listener(self._name, old_state, new_state)
            except Exception:
                logger.exception("breaker listener failed for provider %r", self._name)

    def _settle(self, permit: BreakerPermit, success: bool | None) -> None:
        now = self._clock()
        if self._state is _OPEN:
            self._refresh(now)
        if permit._generation != self._generation:
            return  # granted before the last transition: its verdict is stale
        if permit.kind is _NORMAL:
            if success is None or self._state is not _CLOSED:
                return
            self._prune(now)
            self._outcomes.append((now, success))
            if not success:
                self._failures += 1
                settings = self._settings
                total = len(self._outcomes)
                if (
                    total >= settings.minimum_requests
                    and self._failures >= settings.failure_rate_threshold * total
                ):
                    self._open(
                        now,
                        f"{self._failures} of {total} attempts failed in {settings.window:g} s",
                    )
            return
        # The probe, or a forced probe: its verdict decides the state.
        if success is None:
            if self._probe is not None and self._probe() is permit:
                self._probe = None
            return
        if success:
            self._transition(BreakerState.CLOSED, "the probe succeeded")
            self._clear()
        else:
            self._open(now, "the probe failed")

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self._name!r} {self._state.value}>"


class CircuitBreakerRegistry:
    """One breaker per provider name, created on first use with shared settings and clock.

    Pass `registry.get` as the `breaker_factory` of several failover clients so that every
    route sees the same health for a provider. Listeners added here are attached to every
    breaker, existing and future.
    """

    def __init__(self, settings: BreakerSettings | None = None, *, clock: Clock | None = None):
        if settings is not None and not isinstance(settings, BreakerSettings):
            raise TypeError(f"settings must be BreakerSettings, got {type(settings).__name__}")
        if clock is not None and not callable(clock):
            raise TypeError("clock must be callable")
        self._settings = settings if settings is not None else BreakerSettings()
        self._clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}
        self._listeners: list[BreakerListener] = []

    @property
    def settings(self) -> BreakerSettings:
        """The settings new breakers get."""
        return self._settings

    def get(self, name: str) -> CircuitBreaker:
        """The breaker of provider `name`, created if needed."""
        if name is None:
            raise TypeError("name must not be None")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        breaker = self._breakers.get(name)
        if breaker is None:
            breaker = CircuitBreaker(name, self._settings, clock=self._clock)
            for listener in self._listeners:
                breaker.add_listener(listener)
            self._breakers[name] = breaker
        return breaker

    def add_listener(self, listener: BreakerListener) -> None:
        """Call `listener(name, old_state, new_state)` on every transition of every breaker."""
        if listener is None:
            raise TypeError("listener must not be None")
        if not callable(listener):
            raise TypeError("listener must be callable")
        self._listeners.append(listener)
        for breaker in self._breakers.values():
            breaker.add_listener(listener)

    def remove_listener(self, listener: BreakerListener) -> None:
        """Stop calling `listener` for any breaker; raises ValueError if it was not added."""
        try:
            self._listeners.remove(listener)
        except ValueError:
            raise ValueError("listener was not added to this registry") from None
        for breaker in self._breakers.values():
            with contextlib.suppress(ValueError):
                breaker.remove_listener(listener)

    def __iter__(self) -> Iterator[CircuitBreaker]:
        return iter(tuple(self._breakers.values()))

    def __len__(self) -> int:
        return len(self._breakers)

    def __contains__(self, name: object) -> bool:
        return name in self._breakers
