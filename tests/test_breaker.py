"""Circuit breaker: sliding-window failure rate, minimum requests, cool-down and single probe."""

from __future__ import annotations

import gc

import pytest

from chatroute.failover.breaker import (
    BreakerSettings,
    BreakerState,
    CircuitBreaker,
    CircuitBreakerRegistry,
    PermitKind,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(
    clock: Clock,
    *,
    rate: float = 0.5,
    minimum: int = 4,
    window: float = 10.0,
    cool_down: float = 5.0,
) -> tuple[CircuitBreaker, list[tuple[str, BreakerState, BreakerState]]]:
    settings = BreakerSettings(
        failure_rate_threshold=rate, minimum_requests=minimum, window=window, cool_down=cool_down
    )
    breaker = CircuitBreaker("primary", settings, clock=clock)
    transitions: list[tuple[str, BreakerState, BreakerState]] = []
    breaker.add_listener(lambda name, old, new: transitions.append((name, old, new)))
    return breaker, transitions


def outcome(breaker: CircuitBreaker, ok: bool) -> None:
    permit = breaker.try_acquire()
    assert permit is not None
    if ok:
        permit.record_success()
    else:
        permit.record_failure()


def open_breaker(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.settings.minimum_requests):
        outcome(breaker, False)
    assert breaker.state is BreakerState.OPEN


def test_stays_closed_below_the_minimum_request_count() -> None:
    clock = Clock()
    breaker, transitions = make(clock, minimum=4)
    for _ in range(3):
        outcome(breaker, False)
    snap = breaker.snapshot()
    assert snap.state is BreakerState.CLOSED
    assert (snap.failures, snap.successes, snap.total) == (3, 0, 3)
    assert snap.failure_rate == 1.0
    assert transitions == []
    outcome(breaker, False)  # the fourth outcome reaches the minimum
    assert breaker.state is BreakerState.OPEN
    assert transitions == [("primary", BreakerState.CLOSED, BreakerState.OPEN)]


def test_opens_only_when_the_failure_rate_reaches_the_threshold() -> None:
    clock = Clock()
    breaker, _ = make(clock, rate=0.5, minimum=4)
    for ok in (True, True, True, False, False):
        outcome(breaker, ok)
    assert breaker.state is BreakerState.CLOSED  # 2 of 5 = 40 %
    outcome(breaker, False)  # 3 of 6 = 50 %
    assert breaker.state is BreakerState.OPEN


def test_outcomes_older_than_the_window_are_forgotten() -> None:
    clock = Clock()
    breaker, _ = make(clock, minimum=4, window=10.0)
    for _ in range(3):
        outcome(breaker, False)
    clock.advance(10.5)
    assert breaker.snapshot().total == 0
    outcome(breaker, False)  # only one failure in the window now
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot().failures == 1


def test_open_refuses_until_the_cool_down_then_lets_exactly_one_probe_through() -> None:
    clock = Clock()
    breaker, transitions = make(clock, cool_down=5.0)
    open_breaker(breaker)
    assert breaker.try_acquire() is None
    assert breaker.remaining_cool_down() == pytest.approx(5.0)
    clock.advance(4.9)
    assert breaker.try_acquire() is None
    clock.advance(0.1)
    assert breaker.state is BreakerState.HALF_OPEN
    probe = breaker.try_acquire()
    assert probe is not None and probe.kind is PermitKind.PROBE
    assert breaker.probe_in_flight
    assert breaker.try_acquire() is None  # one probe at a time
    assert breaker.try_acquire() is None
    probe.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot().total == 0  # closed with an empty window
    assert [(old, new) for _, old, new in transitions] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]


def test_failed_probe_opens_again_with_a_fresh_cool_down() -> None:
    clock = Clock()
    breaker, transitions = make(clock, cool_down=5.0)
    open_breaker(breaker)
    clock.advance(5.0)
    probe = breaker.try_acquire()
    assert probe is not None
    clock.advance(1.0)
    probe.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.remaining_cool_down() == pytest.approx(5.0)
    clock.advance(4.0)
    assert breaker.try_acquire() is None
    clock.advance(1.0)
    assert breaker.try_acquire() is not None
    assert transitions[-2:] == [
        ("primary", BreakerState.HALF_OPEN, BreakerState.OPEN),
        ("primary", BreakerState.OPEN, BreakerState.HALF_OPEN),
    ]


def test_released_probe_frees_the_slot_without_a_verdict() -> None:
    clock = Clock()
    breaker, _ = make(clock)
    open_breaker(breaker)
    clock.advance(5.0)
    probe = breaker.try_acquire()
    assert probe is not None
    probe.release()
    assert breaker.state is BreakerState.HALF_OPEN
    second = breaker.try_acquire()
    assert second is not None and second.kind is PermitKind.PROBE


def test_abandoned_probe_frees_the_slot_when_collected() -> None:
    clock = Clock()
    breaker, _ = make(clock)
    open_breaker(breaker)
    clock.advance(5.0)
    probe = breaker.try_acquire()
    assert probe is not None
    assert breaker.try_acquire() is None
    del probe
    gc.collect()
    assert not breaker.probe_in_flight
    assert breaker.try_acquire() is not None


def test_settling_twice_counts_once() -> None:
    clock = Clock()
    breaker, _ = make(clock, minimum=2)
    permit = breaker.try_acquire()
    assert permit is not None
    permit.record_failure()
    permit.record_failure()
    permit.record_success()
    assert breaker.snapshot().total == 1
    assert breaker.state is BreakerState.CLOSED


def test_outcomes_of_permits_from_before_a_transition_are_ignored() -> None:
    clock = Clock()
    breaker, _ = make(clock)
    stale = breaker.try_acquire()
    assert stale is not None
    open_breaker(breaker)
    clock.advance(5.0)
    probe = breaker.try_acquire()
    assert probe is not None
    stale.record_success()  # granted while closed, before the breaker opened
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.probe_in_flight

    probe.record_success()  # closed again, with an empty window
    stale.record_failure()  # granted in the first closed spell: not in this window
    assert breaker.state is BreakerState.CLOSED
    assert breaker.snapshot().failures == 0

    breaker.trip()
    forced = breaker.force_acquire()
    breaker.trip()  # a restarted cool-down voids what was granted before it
    forced.record_success()
    assert breaker.state is BreakerState.OPEN
    assert breaker.remaining_cool_down() == pytest.approx(5.0)


def test_trip_opens_at_once_and_reset_closes() -> None:
    clock = Clock()
    breaker, transitions = make(clock)
    outcome(breaker, True)
    breaker.trip()
    assert breaker.state is BreakerState.OPEN
    assert breaker.try_acquire() is None
    breaker.reset()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.try_acquire() is not None
    assert [new for _, _, new in transitions] == [BreakerState.OPEN, BreakerState.CLOSED]


def test_trip_with_remaining_carries_over_the_rest_of_a_cool_down() -> None:
    clock = Clock()
    breaker, transitions = make(clock, cool_down=5.0)
    breaker.trip(remaining=2.0)
    assert breaker.state is BreakerState.OPEN
    assert breaker.remaining_cool_down() == pytest.approx(2.0)
    clock.advance(1.9)
    assert breaker.try_acquire() is None
    clock.advance(0.2)
    assert breaker.state is BreakerState.HALF_OPEN
    breaker.trip(remaining=60.0)  # never longer than the breaker's own cool-down
    assert breaker.remaining_cool_down() == pytest.approx(5.0)
    assert [new for _, _, new in transitions] == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
    ]
    with pytest.raises(ValueError, match="remaining"):
        breaker.trip(remaining=-1.0)
    with pytest.raises(TypeError, match="remaining"):
        breaker.trip(remaining="soon")  # type: ignore[arg-type]


def test_forced_permit_on_an_open_breaker_decides_its_state() -> None:
    clock = Clock()
    breaker, _ = make(clock, cool_down=5.0)
    open_breaker(breaker)
    forced = breaker.force_acquire()
    assert forced.kind is PermitKind.FORCED
    forced.record_success()
    assert breaker.state is BreakerState.CLOSED

    open_breaker(breaker)
    clock.advance(3.0)
    forced = breaker.force_acquire()
    forced.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.remaining_cool_down() == pytest.approx(5.0)  # restarted


def test_force_acquire_on_a_closed_breaker_is_a_normal_permit() -> None:
    breaker, _ = make(Clock())
    assert breaker.force_acquire().kind is PermitKind.NORMAL


def test_a_failing_listener_does_not_break_the_breaker(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    breaker, transitions = make(clock, minimum=1)

    def broken(name: str, old: BreakerState, new: BreakerState) -> None:
        raise RuntimeError("exporter down")

    breaker.add_listener(broken)
    outcome(breaker, False)
    assert breaker.state is BreakerState.OPEN
    assert len(transitions) == 1
    assert "exporter down" in caplog.text
    breaker.remove_listener(broken)
    with pytest.raises(ValueError, match="not added"):
        breaker.remove_listener(broken)


def test_registry_shares_one_breaker_per_name_and_listeners() -> None:
    clock = Clock()
    registry = CircuitBreakerRegistry(BreakerSettings(minimum_requests=1), clock=clock)
    seen: list[str] = []
    first = registry.get("a")
    registry.add_listener(lambda name, old, new: seen.append(name))
    second = registry.get("b")
    assert registry.get("a") is first
    assert len(registry) == 2 and "a" in registry and "c" not in registry
    outcome(first, False)
    outcome(second, False)
    assert seen == ["a", "b"]
    assert [b.name for b in registry] == ["a", "b"]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"failure_rate_threshold": 0}, ValueError),
        ({"failure_rate_threshold": 1.5}, ValueError),
        ({"failure_rate_threshold": "0.5"}, TypeError),
        ({"minimum_requests": 0}, ValueError),
        ({"minimum_requests": True}, TypeError),
        ({"window": 0}, ValueError),
        ({"window": float("nan")}, ValueError),
        ({"cool_down": -1}, ValueError),
        ({"cool_down": None}, TypeError),
    ],
)
def test_bad_settings_are_rejected(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        BreakerSettings(**kwargs)  # type: ignore[arg-type]


def test_bad_constructor_arguments_are_rejected() -> None:
    with pytest.raises(TypeError):
        CircuitBreaker(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CircuitBreaker("x", settings={})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CircuitBreaker("x", clock=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CircuitBreaker("x").add_listener(None)  # type: ignore[arg-type]
