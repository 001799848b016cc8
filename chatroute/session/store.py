"""Session stores: where a conversation's route and provider are kept between its requests."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["InMemorySessionStore", "SessionRecord", "SessionStore"]


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What a conversation's last answered request left: its route, the provider that served
    it and that provider's family ("openai" or "anthropic"; None when not known)."""

    route: str
    provider: str
    family: str | None = None


@runtime_checkable
class SessionStore(Protocol):
    """Keeps one `SessionRecord` per conversation key, for a bounded time.

    `get` and `put` never raise for the store's own faults and never wait long: a store that
    cannot answer says None (the request is then routed as a new conversation) and drops
    the write. Keys come from `conversation_key` (short, ASCII, opaque).
    """

    async def get(self, key: str) -> SessionRecord | None:
        """The record under `key`, or None (none, expired, or the store is unreachable)."""

    async def put(self, key: str, record: SessionRecord) -> None:
        """Store `record` under `key`, restarting its time to live."""

    async def aclose(self) -> None:
        """Release what the store holds; idempotent."""


def check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


class InMemorySessionStore:
    """A session store in this process: at most `max_sessions` records (least recently used
    go first), each forgotten `ttl` seconds after it was last written."""

    def __init__(
        self,
        *,
        max_sessions: int = 100_000,
        ttl: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int):
            raise TypeError("max_sessions must be an int")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, got {max_sessions}")
        self._max = max_sessions
        self._ttl = check_positive("ttl", ttl)
        self._clock = clock
        self._records: OrderedDict[str, tuple[float, SessionRecord]] = OrderedDict()

    @property
    def ttl(self) -> float:
        """Seconds a record lives after its last write."""
        return self._ttl

    @property
    def max_sessions(self) -> int:
        """How many records are kept at most."""
        return self._max

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, key: str) -> SessionRecord | None:
        entry = self._records.get(key)
        if entry is None:
            return None
        expires, record = entry
        if expires <= self._clock():
            del self._records[key]
            return None
        self._records.move_to_end(key)
        return record

    async def put(self, key: str, record: SessionRecord) -> None:
        if not isinstance(record, SessionRecord):
            raise TypeError("record must be a SessionRecord")
        self._records[key] = (self._clock() + self._ttl, record)
        self._records.move_to_end(key)
        while len(self._records) > self._max:
            self._records.popitem(last=False)

    async def aclose(self) -> None:
        self._records.clear()
