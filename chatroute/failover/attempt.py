"""FailoverChatClientAttempt: the immutable record of one client invocation in a failover loop."""

from __future__ import annotations

import math
from dataclasses import dataclass

from chatroute.chat.client import ChatClient

__all__ = ["FailoverChatClientAttempt"]


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float number of seconds, got {type(value).__name__}")
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class FailoverChatClientAttempt:
    """What one invocation of one client did; built by the failover loop, read by policies.

    `duration` and `time_to_first_update` are seconds of active invocation time measured
    with `time.perf_counter()`. `exception is None` does not by itself mean success:
    check `response_completed`. Construction checks the record's invariants and raises
    `ValueError` when one does not hold.
    """

    client: ChatClient
    duration: float
    time_to_first_update: float | None
    exception: BaseException | None
    response_completed: bool
    output_committed: bool

    def __post_init__(self) -> None:
        # Fast path for the records the failover loop builds (float seconds, real bools);
        # anything else goes through the full checks, which raise the precise error.
        duration = self.duration
        ttfu = self.time_to_first_update
        exception = self.exception
        if (
            type(duration) is float
            and duration >= 0.0
            and (ttfu is None or (type(ttfu) is float and 0.0 <= ttfu <= duration))
            and self.client is not None
            and (exception is None or isinstance(exception, BaseException))
            and type(self.response_completed) is bool
            and type(self.output_committed) is bool
            and not (self.response_completed and exception is not None)
            and self.output_committed == (ttfu is not None)
        ):
            return
        self._check()

    def _check(self) -> None:
        if self.client is None:
            raise TypeError("client must not be None")
        duration = _check_seconds("duration", self.duration)
        ttfu = self.time_to_first_update
        if ttfu is not None:
            ttfu = _check_seconds("time_to_first_update", ttfu)
            if ttfu > duration:
                raise ValueError(
                    f"time_to_first_update ({ttfu!r}) must not exceed duration ({duration!r})"
                )
        if self.exception is not None and not isinstance(self.exception, BaseException):
            raise TypeError(
                f"exception must be a BaseException or None, got {type(self.exception).__name__}"
            )
        if not isinstance(self.response_completed, bool):
            raise TypeError("response_completed must be a bool")
        if not isinstance(self.output_committed, bool):
            raise TypeError("output_committed must be a bool")
        if self.response_completed and self.exception is not None:
            raise ValueError("a completed response cannot carry an exception")
        if self.output_committed != (ttfu is not None):
            raise ValueError(
                "output_committed must be True exactly when time_to_first_update is set"
            )
