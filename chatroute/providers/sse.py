"""Server-sent events read from an HTTP body's byte chunks, with a bound on each event's size."""

from __future__ import annotations

from collections.abc import AsyncIterator

__all__ = ["MAX_EVENT_BYTES", "SSEReader"]

# The most one server-sent event (or one line of it) may hold.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class SSEReader:
    """Server-sent events from a body's byte chunks, as (event name, data) pairs.

    Lines end in LF, CRLF or CR (a CRLF split across chunks included); a blank line
    dispatches the event gathered so far (its `data:` lines joined by LF); comment lines
    (`:` first) are skipped, as are unknown fields; one space after the colon is dropped.
    An event left unterminated when the body ends is still returned. Text is UTF-8, bad
    bytes replaced. An event or line over `MAX_EVENT_BYTES` raises ValueError.
    """

    __slots__ = ("_chunks", "_data", "_event", "_lines", "_size", "_skip_lf", "_tail")

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._lines: list[bytes] = []
        self._tail = b""
        self._skip_lf = False
        self._data: list[bytes] = []
        self._size = 0
        self._event: bytes | None = None

    def _feed(self, chunk: bytes) -> None:
        if self._skip_lf:
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        lines = chunk.splitlines(keepends=True)
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            self._tail = lines.pop()
            if len(self._tail) > MAX_EVENT_BYTES:
                raise ValueError(f"an event line longer than {MAX_EVENT_BYTES} bytes")
        elif chunk.endswith(b"\r"):
            self._skip_lf = True  # the LF of a CRLF may open the next chunk
        # Called only once every earlier line is consumed; lines are taken from the end.
        lines.reverse()
        self._lines.extend(lines)

    def _dispatch(self) -> tuple[str | None, str]:
        event = self._event.decode("utf-8", "replace") if self._event is not None else None
        data = b"\n".join(self._data).decode("utf-8", "replace")
        self._data = []
        self._size = 0
        self._event = None
        return event, data

    async def next(self) -> tuple[str | None, str] | None:
        """The next event, or None at the end of the body."""
        lines = self._lines
        while True:
            while lines:
                line = lines.pop().rstrip(b"\r\n")
                if not line:
                    if self._data:
                        return self._dispatch()
                    self._event = None
                elif line[0] != 0x3A:  # not a ":" comment (keep-alive)
                    name, _, value = line.partition(b":")
                    if value[:1] == b" ":
                        value = value[1:]
                    if name == b"data":
                        self._size += len(value)
                        if self._size > MAX_EVENT_BYTES:
                            raise ValueError(f"an event larger than {MAX_EVENT_BYTES} bytes")
                        self._data.append(value)
                    elif name == b"event":
                        self._event = value
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                if self._tail:
                    lines.append(self._tail)
                    self._tail = b""
                    continue
                return self._dispatch() if self._data else None
            self._feed(chunk)
