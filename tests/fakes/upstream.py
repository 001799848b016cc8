"""A scripted OpenAI-compatible upstream: a real HTTP/1.1 server on 127.0.0.1 with faults on cue.

The server is written directly on asyncio streams, so every byte it sends (and every fault:
resets, hangs, cuts, stalls, malformed chunks) is under the test's control. It runs its own
event loop in a background thread, so it serves sync clients, async clients and a uvicorn
server under test living in the same process alike.

Usage::

    with FakeUpstream() as up:                     # or: async with FakeUpstream() as up:
        up.base_url                                # 'http://127.0.0.1:PORT/v1'
        up.script(Status(503), Ok("hi"))           # one behaviour per chat request, in order
        up.default = Ok("fallback text")           # used once the script is empty
        up.handler = lambda req: Hang() if req.stream else None   # optional; None -> default
        ...  # point a client at up.base_url
        assert up.attempts == 2                    # chat-completion requests that reached it
        up.requests[0].json["messages"]            # parsed body, headers, arrival time, ...
        up.wait_for_disconnect(0, timeout=1.0)     # monotonic time the client hung up

Endpoints: ``POST /v1/chat/completions`` (``stream`` true or false, the OpenAI wire format;
SSE events are ``data: {...}\\n\\n`` ending with ``data: [DONE]``; the stream is sent with
chunked transfer encoding, one HTTP chunk per SSE event) and ``GET /v1/models`` (lists
``models``). Any other path answers 404 in the OpenAI error shape.

Choosing a behaviour for a chat request: the next scripted step if the queue is not empty;
otherwise ``handler(request)`` when a handler is set and returns a behaviour (it runs on
the fake's own thread); otherwise ``default``. ``pending`` counts the unconsumed steps and
``reset()`` forgets the script and the records. Behaviours:

- ``Ok``: a normal answer. ``text`` is split into ``chunks`` pieces (default: one piece per
  word); ``reasoning`` is streamed as ``reasoning_content`` before the text, ``refusal``
  as ``refusal`` deltas after it, ``tool_calls`` after the text; ``logprobs=True`` adds a
  made-up ``logprobs`` object to the choice (streamed: to each content chunk). ``model``
  defaults to the requested model. A role-only first delta
  (``{"role": "assistant", "content": ""}``) is sent before content unless
  ``role_chunk=False``; ``empty_choices_first`` and ``keepalives`` add non-content events
  before it. Timing: ``delay`` (before the status line), ``first_token_delay`` (after the
  role delta, before the first content chunk; non-streaming: before the status line too),
  ``chunk_delay`` (between content chunks), ``paused_after=N`` with ``resume`` (a
  ``threading.Event``: after N content chunks, send nothing more until it is set). Usage
  is sent in non-streaming answers always, in streams only when the request asked for
  ``stream_options.include_usage`` (a final chunk with empty ``choices``). Faults on an
  ``Ok``: ``cut_after=N`` (send N content chunks, then close the connection abruptly
  mid-body; ``rst=True`` resets instead), ``stall_after=N``
  (send N content chunks, then send nothing until the client leaves), ``malformed_at=N``
  (content chunk N is not JSON), ``error_at=N`` (an SSE ``{"error": ...}`` event replaces
  content chunk N and the stream ends without ``[DONE]``), ``finish_reason=None`` (no
  finishing chunk), ``done=False`` (no ``data: [DONE]``; the body still ends cleanly),
  ``hold_open=True`` (after the last event the body never ends; the connection stays
  open until the client leaves), ``abort_at_end=True`` (after the last event the
  connection is closed abruptly, leaving the chunked body unterminated).
  Factories name the common cases: ``SlowFirstToken``, ``Cut``, ``Stall``, ``Malformed``,
  ``ErrorEvent``, ``NoDone``, ``Truncated``.
- ``Status``: an HTTP status with a body (default: the OpenAI error shape) and headers.
  Factories: ``RateLimited`` (429 with ``Retry-After``), ``ServerError`` (500),
  ``Unavailable`` (503), ``ContextLengthExceeded`` and ``ContentPolicy`` (400),
  ``Unauthorized`` (401), ``ModelNotFound`` (404).
- ``Events``: a 200 event stream of exactly the given SSE texts (anything the named
  behaviours cannot express: named events, odd framing), ending cleanly, cut or held.
- ``Reset``: read the request, then reset the TCP connection (SO_LINGER 0) before any
  header.
- ``Hang``: read the request, then send nothing until the client disconnects.

Records: ``requests`` lists the chat-completion requests (``all_requests`` every request)
as ``Request`` objects: method, path, lower-cased headers, raw body, parsed ``json``,
``arrived_at`` (``time.monotonic()``, comparable with the test's own clock), the
``behaviour`` used, ``chunks_sent``, ``finished_at`` and the ``Connection`` it came on.
A ``Connection`` records ``client_closed_at`` (when the client closed or reset it while
the server had not) and ``server_closed_at``. ``wait_for_requests``,
``wait_for_disconnect``, ``wait_for_finish`` and their async twins ``await_requests`` /
``await_disconnect`` / ``await_finish`` wait for these, raising ``TimeoutError`` after
``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from types import TracebackType
from typing import Any, Literal, Self

__all__ = [
    "Behaviour",
    "Connection",
    "ContentPolicy",
    "ContextLengthExceeded",
    "Cut",
    "ErrorEvent",
    "Events",
    "FakeUpstream",
    "Hang",
    "Malformed",
    "ModelNotFound",
    "NoDone",
    "Ok",
    "RateLimited",
    "Request",
    "Reset",
    "ServerError",
    "SlowFirstToken",
    "Stall",
    "Status",
    "ToolCall",
    "Truncated",
    "Unauthorized",
    "Unavailable",
]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    413: "Payload Too Large",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

_ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}


# ---------------------------------------------------------------------------- behaviours


class Behaviour:
    """What the fake does with one chat-completion request (see the module docstring)."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call in an `Ok` answer; `arguments` is streamed in `chunks` pieces."""

    name: str
    arguments: str = "{}"
    id: str | None = None
    chunks: int = 2


@dataclass(frozen=True)
class Ok(Behaviour):
    """A normal answer, optionally with a stream fault (cut, stall, malformed, error event)."""

    text: str = "Hello from the fake upstream."
    _: KW_ONLY
    chunks: int | None = None
    pieces: Sequence[str] | None = None
    model: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    logprobs: bool = False
    tool_calls: Sequence[ToolCall] = ()
    finish_reason: str | None = "stop"
    prompt_tokens: int = 10
    completion_tokens: int | None = None
    usage_extra: Mapping[str, Any] | None = None
    response_id: str | None = None
    system_fingerprint: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0
    first_token_delay: float = 0.0
    chunk_delay: float = 0.0
    paused_after: int | None = None
    resume: threading.Event | None = None
    role_chunk: bool = True
    empty_choices_first: bool = False
    keepalives: int = 0
    done: bool = True
    hold_open: bool = False
    abort_at_end: bool = False
    cut_after: int | None = None
    rst: bool = False
    stall_after: int | None = None
    malformed_at: int | None = None
    error_at: int | None = None
    error: Mapping[str, Any] | None = None

    def text_pieces(self) -> list[str]:
        """The text split the way it is streamed."""
        if self.pieces is not None:
            return list(self.pieces)
        if not self.text:
            return []
        if self.chunks is None:
            words = re.findall(r"\S+\s*", self.text)
            if not words:
                return [self.text]
            lead = self.text[: len(self.text) - len(self.text.lstrip())]
            return [lead + words[0], *words[1:]]
        n = max(1, min(self.chunks, len(self.text)))
        size, extra = divmod(len(self.text), n)
        out, pos = [], 0
        for i in range(n):
            step = size + (1 if i < extra else 0)
            out.append(self.text[pos : pos + step])
            pos += step
        return out


@dataclass(frozen=True)
class Status(Behaviour):
    """An HTTP status answer; `body` None means the OpenAI error shape for the status."""

    status: int
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0
    message: str | None = None
    code: str | None = None
    type: str | None = None


@dataclass(frozen=True)
class Events(Behaviour):
    """A 200 event stream made of exactly these SSE texts, each sent as one HTTP chunk.

    Each item is written verbatim (include the ``data: `` prefix and the blank line).
    ``end``: "clean" terminates the body, "cut" closes the connection abruptly, "hold"
    keeps it open until the client leaves.
    """

    events: Sequence[str | bytes]
    chunk_delay: float = 0.0
    end: Literal["clean", "cut", "hold"] = "clean"
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reset(Behaviour):
    """Read the request, then reset the TCP connection before sending any header."""

    delay: float = 0.0


@dataclass(frozen=True)
class Hang(Behaviour):
    """Read the request, then say nothing until the client disconnects."""


def RateLimited(retry_after: float | None = 1.0, *, retry_after_ms: float | None = None) -> Status:
    """429 with `Retry-After` (seconds) and/or `retry-after-ms` headers."""
    headers: dict[str, str] = {}
    if retry_after is not None:
        headers["Retry-After"] = f"{retry_after:g}"
    if retry_after_ms is not None:
        headers["retry-after-ms"] = f"{retry_after_ms:g}"
    return Status(429, headers=headers, message="Rate limit reached for requests")


def ServerError(status: int = 500) -> Status:
    """A 5xx answer (500 by default)."""
    return Status(status, message="The server had an error while processing your request.")


def Unavailable() -> Status:
    """503 Service Unavailable."""
    return Status(503, message="The engine is currently overloaded, please try again later")


def ContextLengthExceeded(max_tokens: int = 8192) -> Status:
    """400 context_length_exceeded, as OpenAI sends it."""
    return Status(
        400,
        message=(
            f"This model's maximum context length is {max_tokens} tokens. However, your "
            f"messages resulted in {max_tokens + 1000} tokens. Please reduce the length of "
            "the messages."
        ),
        type="invalid_request_error",
        code="context_length_exceeded",
    )


def ContentPolicy() -> Status:
    """400 content_policy_violation."""
    return Status(
        400,
        message="Your request was rejected as a result of our safety system.",
        type="invalid_request_error",
        code="content_policy_violation",
    )


def Unauthorized() -> Status:
    """401 invalid_api_key."""
    return Status(401, message="Incorrect API key provided.")


def ModelNotFound(model: str = "missing-model") -> Status:
    """404 model_not_found."""
    return Status(404, message=f"The model `{model}` does not exist or you do not have access.")


def SlowFirstToken(delay: float, text: str = "Hello from the fake upstream.", **kw: Any) -> Ok:
    """Headers and the role delta at once, then `delay` seconds before the first content."""
    return Ok(text, first_token_delay=delay, **kw)


def Cut(after: int, text: str = "one two three four five six", **kw: Any) -> Ok:
    """Send `after` content chunks, then close the connection abruptly mid-body."""
    return Ok(text, cut_after=after, **kw)


def Stall(after: int, text: str = "one two three four five six", **kw: Any) -> Ok:
    """Send `after` content chunks, then nothing until the client leaves."""
    return Ok(text, stall_after=after, **kw)


def Malformed(at: int = 0, text: str = "one two three four five six", **kw: Any) -> Ok:
    """Content chunk `at` (0 = the first) is not JSON."""
    return Ok(text, malformed_at=at, **kw)


def ErrorEvent(
    at: int = 0,
    message: str = "The server had an error while processing your request.",
    *,
    text: str = "one two three four five six",
    code: str | None = "server_error",
    **kw: Any,
) -> Ok:
    """An SSE `{"error": ...}` event in place of content chunk `at`; no `[DONE]` follows."""
    err = {"message": message, "type": "server_error", "param": None, "code": code}
    return Ok(text, error_at=at, error=err, **kw)


def NoDone(text: str = "one two three", **kw: Any) -> Ok:
    """A complete stream (with finish_reason) whose body ends without `data: [DONE]`."""
    return Ok(text, done=False, **kw)


def Truncated(after: int, text: str = "one two three four five six", **kw: Any) -> Ok:
    """`after` content chunks, then a clean end of body with no finish_reason and no [DONE]."""
    pieces = Ok(text).text_pieces()[:after]
    return Ok(text, pieces=pieces, finish_reason=None, done=False, **kw)


# ---------------------------------------------------------------------------- records


@dataclass(eq=False)
class Connection:
    """One TCP connection the fake accepted."""

    id: int
    opened_at: float
    client_closed_at: float | None = None
    server_closed_at: float | None = None
    request_indices: list[int] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        """True once either side closed it."""
        return self.client_closed_at is not None or self.server_closed_at is not None


@dataclass(eq=False)
class Request:
    """One HTTP request the fake received and what it did about it."""

    index: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    arrived_at: float
    connection: Connection
    behaviour: Behaviour | None = None
    status: int | None = None
    chunks_sent: int = 0
    """Stream chunks written, each counted just before its write: a client that has read
    a chunk always finds it counted (a count made after the write can lag behind a fast
    reader on another thread)."""
    finished_at: float | None = None
    query: str = ""
    """The raw query string of the request target ('' without one)."""

    @property
    def stream(self) -> bool:
        """Whether the body asked for a stream."""
        return isinstance(self.json, dict) and bool(self.json.get("stream"))

    @property
    def model(self) -> str | None:
        """The model named in the body."""
        return self.json.get("model") if isinstance(self.json, dict) else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The messages of the body (empty when absent)."""
        if isinstance(self.json, dict) and isinstance(self.json.get("messages"), list):
            return self.json["messages"]
        return []

    @property
    def disconnected_at(self) -> float | None:
        """When the client closed this request's connection (None: not yet, or server did)."""
        return self.connection.client_closed_at


class _Gone(Exception):
    """The client went away while the fake was answering."""


class _Conn:
    """Per-connection state on the server loop."""

    def __init__(
        self,
        record: Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        notify: Callable[[], None],
    ) -> None:
        self.record = record
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.data = asyncio.Event()
        self.eof = asyncio.Event()
        self.server_closing = False
        self._notify = notify
        self.pump_task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            while True:
                chunk = await self.reader.read(65536)
                if not chunk:
                    break
                self.buf += chunk
                self.data.set()
        except (ConnectionError, OSError):
            pass
        finally:
            if not self.server_closing:
                self.client_gone()

    def client_gone(self) -> None:
        """Record that the client closed or reset the connection (once)."""
        if self.record.client_closed_at is None and self.record.server_closed_at is None:
            self.record.client_closed_at = time.monotonic()
            self._notify()
        self.eof.set()
        self.data.set()

    async def read_until(self, marker: bytes) -> bytes | None:
        while True:
            pos = self.buf.find(marker)
            if pos >= 0:
                out = bytes(self.buf[: pos + len(marker)])
                del self.buf[: pos + len(marker)]
                return out
            if self.eof.is_set():
                return None
            self.data.clear()
            await self.data.wait()

    async def read_exact(self, n: int) -> bytes | None:
        while len(self.buf) < n:
            if self.eof.is_set():
                return None
            self.data.clear()
            await self.data.wait()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def sleep(self, seconds: float) -> None:
        """Sleep, raising _Gone as soon as the client disconnects."""
        if self.eof.is_set():
            raise _Gone
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.eof.wait(), seconds)
        if self.eof.is_set():
            raise _Gone

    async def send(self, data: bytes) -> None:
        if self.eof.is_set():
            raise _Gone
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            self.client_gone()  # a failed write means the client reset the connection
            raise _Gone from None

    def close(self, *, rst: bool = False) -> None:
        self.server_closing = True
        if self.record.server_closed_at is None and self.record.client_closed_at is None:
            self.record.server_closed_at = time.monotonic()
            self._notify()
        if rst:
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


def _logprobs(pieces: Sequence[str]) -> dict[str, Any]:
    """OpenAI's `logprobs` object for text pieces, one token each, with made-up values."""
    return {
        "content": [
            {"token": p, "logprob": -0.25, "bytes": list(p.encode()), "top_logprobs": []}
            for p in pieces
        ],
        "refusal": None,
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _scripted_break(conn: _Conn, ok: Ok, sent: int, *, at_end: bool = False) -> bool:
    """Cut or stall the stream where `ok` scripts it, with `sent` content chunks written
    (`at_end`: all of them, and no cut or stall came earlier, so any scripted one is due);
    True when it did, and the answer ends there."""
    if ok.cut_after is not None and (at_end or sent >= ok.cut_after):
        conn.close(rst=ok.rst)
        return True
    if ok.stall_after is not None and (at_end or sent >= ok.stall_after):
        await conn.eof.wait()
        return True
    return False


def _scripted_body(status: Status) -> bytes | None:
    """The body a `Status` scripts as it is (bytes, text or JSON); None when it scripts none."""
    if status.body is None:
        return None
    if isinstance(status.body, bytes):
        return status.body
    if isinstance(status.body, str):
        return status.body.encode()
    return json.dumps(status.body).encode()


def _error_body(status: Status) -> bytes:
    scripted = _scripted_body(status)
    if scripted is not None:
        return scripted
    etype, code = _ERROR_TYPES.get(status.status, ("server_error", None))
    if status.status >= 500:
        etype = "server_error"
    err = {
        "message": status.message or f"fake upstream error {status.status}",
        "type": status.type or etype,
        "param": None,
        "code": status.code if status.code is not None else code,
    }
    return json.dumps({"error": err}).encode()


# ---------------------------------------------------------------------------- the server


class FakeUpstream:
    """A scripted OpenAI-compatible HTTP server on 127.0.0.1 (see the module docstring)."""

    chat_path = "/chat/completions"
    """The path suffix of the requests that behaviours answer."""

    def __init__(
        self,
        *steps: Behaviour,
        default: Behaviour | None = None,
        handler: Callable[[Request], Behaviour | None] | None = None,
        models: Sequence[str] = ("fake-model",),
        host: str = "127.0.0.1",
    ) -> None:
        self.default: Behaviour = default if default is not None else Ok()
        self.handler = handler
        self.models = list(models)
        self.host = host
        self.port = 0
        self._steps: deque[Behaviour] = deque(steps)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._all: list[Request] = []
        self._chat: list[Request] = []
        self._connections: list[Connection] = []
        self._conn_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._live: set[_Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, e.g. 'http://127.0.0.1:PORT/v1'."""
        if not self.port:
            raise RuntimeError("FakeUpstream is not started")
        return f"http://{self.host}:{self.port}/v1"

    @property
    def url(self) -> str:
        """The server root, e.g. 'http://127.0.0.1:PORT'."""
        return self.base_url[: -len("/v1")]

    def start(self) -> Self:
        """Start the server thread and wait until it listens."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="fake-upstream", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._start_error is not None:
            raise RuntimeError("FakeUpstream failed to start") from self._start_error
        if not self.port:
            raise RuntimeError("FakeUpstream did not start within 10 s")
        return self

    def close(self) -> None:
        """Stop the server: abort every connection and join the thread; idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = None
        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.close)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._on_connect, self.host, 0, backlog=2048)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            self._loop = loop
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._live):
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ scripting

    def script(self, *steps: Behaviour) -> None:
        """Append behaviours for the next chat requests, consumed in order."""
        for step in steps:
            if not isinstance(step, Behaviour):
                raise TypeError(f"not a Behaviour: {step!r}")
        with self._lock:
            self._steps.extend(steps)

    @property
    def pending(self) -> int:
        """Scripted steps not consumed yet."""
        with self._lock:
            return len(self._steps)

    def reset(self) -> None:
        """Forget the script and every record (connections already open stay open)."""
        with self._lock:
            self._steps.clear()
            self._all.clear()
            self._chat.clear()
            self._connections.clear()

    def _choose(self, request: Request) -> Behaviour:
        with self._lock:
            if self._steps:
                return self._steps.popleft()
        if self.handler is not None:
            chosen = self.handler(request)
            if chosen is not None:
                return chosen
        return self.default

    # ------------------------------------------------------------------ records

    @property
    def requests(self) -> list[Request]:
        """The chat-completion requests received so far (a snapshot)."""
        with self._lock:
            return list(self._chat)

    @property
    def all_requests(self) -> list[Request]:
        """Every request received so far, any path (a snapshot)."""
        with self._lock:
            return list(self._all)

    @property
    def attempts(self) -> int:
        """How many chat-completion requests reached this fake."""
        with self._lock:
            return len(self._chat)

    @property
    def connections(self) -> list[Connection]:
        """Every connection accepted so far (a snapshot)."""
        with self._lock:
            return list(self._connections)

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"FakeUpstream: timed out after {timeout} s waiting {what}")
                self._changed.wait(left)

    def wait_for_requests(self, n: int, timeout: float = 5.0) -> list[Request]:
        """Block until at least `n` chat requests arrived; return them."""
        self._wait(lambda: len(self._chat) >= n, timeout, f"for {n} chat requests")
        return self.requests

    def wait_for_disconnect(self, index: int = -1, timeout: float = 5.0) -> float:
        """Block until the client closed the connection of chat request `index`; return when."""
        self.wait_for_requests(index + 1 if index >= 0 else 1, timeout)

        def closed() -> bool:
            return self._chat[index].connection.client_closed_at is not None

        self._wait(closed, timeout, f"for the client to close request {index}'s connection")
        closed_at = self._chat[index].connection.client_closed_at
        assert closed_at is not None
        return closed_at

    def wait_for_finish(self, index: int = -1, timeout: float = 5.0) -> Request:
        """Block until the fake stopped handling chat request `index`; return its record."""
        self.wait_for_requests(index + 1 if index >= 0 else 1, timeout)
        self._wait(
            lambda: self._chat[index].finished_at is not None, timeout, f"for request {index}"
        )
        return self.requests[index]

    async def await_requests(self, n: int, timeout: float = 5.0) -> list[Request]:
        """Async `wait_for_requests`."""
        return await asyncio.to_thread(self.wait_for_requests, n, timeout)

    async def await_disconnect(self, index: int = -1, timeout: float = 5.0) -> float:
        """Async `wait_for_disconnect`."""
        return await asyncio.to_thread(self.wait_for_disconnect, index, timeout)

    async def await_finish(self, index: int = -1, timeout: float = 5.0) -> Request:
        """Async `wait_for_finish`."""
        return await asyncio.to_thread(self.wait_for_finish, index, timeout)

    # ------------------------------------------------------------------ serving

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        record = Connection(id=next(self._conn_ids), opened_at=time.monotonic())
        with self._lock:
            self._connections.append(record)
        conn = _Conn(record, reader, writer, self._notify)
        self._live.add(conn)
        try:
            while True:
                keep = await self._serve_one(conn)
                if not keep:
                    break
        except (_Gone, asyncio.CancelledError):
            pass
        finally:
            conn.close()
            conn.pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await conn.pump_task
            self._live.discard(conn)
            self._tasks.discard(task)
            self._notify()

    async def _serve_one(self, conn: _Conn) -> bool:
        head = await conn.read_until(b"\r\n\r\n")
        if head is None:
            return False
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _version = lines[0].split(" ", 2)
        except ValueError:
            await conn.send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            return False
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        body = b""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size_line = await conn.read_until(b"\r\n")
                if size_line is None:
                    return False
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                data = await conn.read_exact(size + 2)
                if data is None:
                    return False
                if size == 0:
                    break
                parts.append(data[:-2])
            body = b"".join(parts)
        elif "content-length" in headers:
            data = await conn.read_exact(int(headers["content-length"]))
            if data is None:
                return False
            body = data
        parsed: Any = None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        path, _, query = target.partition("?")
        is_chat = method == "POST" and path.rstrip("/").endswith(self.chat_path)
        with self._lock:
            req = Request(
                index=len(self._chat) if is_chat else -1,
                method=method,
                path=path,
                headers=headers,
                body=body,
                json=parsed,
                arrived_at=time.monotonic(),
                connection=conn.record,
                query=query,
            )
            self._all.append(req)
            if is_chat:
                self._chat.append(req)
                conn.record.request_indices.append(req.index)
        self._notify()
        keep_alive = headers.get("connection", "").lower() != "close"
        try:
            if is_chat:
                if parsed is None or not isinstance(parsed, dict):
                    bad = Status(400, message="We could not parse the JSON body of your request.")
                    req.behaviour = bad
                    return await self._status(conn, req, bad, keep_alive)
                behaviour = self._choose(req)
                req.behaviour = behaviour
                return await self._chat_answer(conn, req, behaviour, keep_alive)
            if method == "GET" and path.rstrip("/").endswith("/models"):
                req.status = 200
                await self._send_json(conn, 200, self._models_listing(), {}, keep_alive)
                return keep_alive
            missing = Status(404, message=f"Unknown path {path}", code="not_found")
            return await self._status(conn, req, missing, keep_alive)
        finally:
            req.finished_at = time.monotonic()
            self._notify()

    def _models_listing(self) -> dict[str, Any]:
        """The answer to `GET /v1/models`."""
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.models
            ],
        }

    async def _send_json(
        self,
        conn: _Conn,
        status: int,
        obj: Any,
        headers: Mapping[str, str],
        keep_alive: bool,
    ) -> None:
        body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        await conn.send(
            self._head(status, "application/json", headers, keep_alive, len(body)) + body
        )

    @staticmethod
    def _head(
        status: int,
        content_type: str,
        headers: Mapping[str, str],
        keep_alive: bool,
        length: int | None,
    ) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines.append(f"Content-Type: {content_type}")
        if length is None:
            lines.append("Transfer-Encoding: chunked")
            lines.append("Cache-Control: no-cache")
        else:
            lines.append(f"Content-Length: {length}")
        lines.append("Connection: " + ("keep-alive" if keep_alive else "close"))
        if not any(k.lower() == "x-request-id" for k in headers):  # a scripted one wins
            lines.append("x-request-id: req-fake")
        for k, v in headers.items():
            lines.append(f"{k}: {v}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _status(self, conn: _Conn, req: Request, status: Status, keep_alive: bool) -> bool:
        await conn.sleep(status.delay)
        req.status = status.status
        await self._send_json(conn, status.status, _error_body(status), status.headers, keep_alive)
        return keep_alive

    async def _chat_answer(
        self, conn: _Conn, req: Request, behaviour: Behaviour, keep_alive: bool
    ) -> bool:
        if isinstance(behaviour, Status):
            return await self._status(conn, req, behaviour, keep_alive)
        if isinstance(behaviour, Reset):
            await conn.sleep(behaviour.delay)
            conn.close(rst=True)
            return False
        if isinstance(behaviour, Hang):
            await conn.eof.wait()
            return False
        if isinstance(behaviour, Events):
            return await self._events(conn, req, behaviour, keep_alive)
        if isinstance(behaviour, Ok):
            if req.stream:
                return await self._stream(conn, req, behaviour, keep_alive)
            return await self._complete(conn, req, behaviour, keep_alive)
        raise TypeError(f"unknown behaviour {behaviour!r}")

    async def _events(self, conn: _Conn, req: Request, ev: Events, keep_alive: bool) -> bool:
        req.status = 200
        await conn.send(self._head(200, "text/event-stream", ev.headers, keep_alive, None))
        for i, item in enumerate(ev.events):
            if i > 0:
                await conn.sleep(ev.chunk_delay)
            data = item.encode() if isinstance(item, str) else item
            req.chunks_sent += 1  # counted as it is written: see `Request.chunks_sent`
            await conn.send(_chunked(data))
        if ev.end == "cut":
            conn.close()
            return False
        if ev.end == "hold":
            await conn.eof.wait()
            return False
        await conn.send(b"0\r\n\r\n")
        return keep_alive

    @staticmethod
    def _usage(ok: Ok, pieces: int) -> dict[str, Any]:
        completion = ok.completion_tokens if ok.completion_tokens is not None else pieces
        usage: dict[str, Any] = {
            "prompt_tokens": ok.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": ok.prompt_tokens + completion,
        }
        if ok.usage_extra:
            usage.update(ok.usage_extra)
        return usage

    @staticmethod
    def _finish(ok: Ok) -> str | None:
        if ok.finish_reason == "stop" and ok.tool_calls and not ok.text:
            return "tool_calls"
        return ok.finish_reason

    async def _complete(self, conn: _Conn, req: Request, ok: Ok, keep_alive: bool) -> bool:
        await conn.sleep(ok.delay + ok.first_token_delay)
        model = ok.model or req.model or "fake-model"
        message: dict[str, Any] = {"role": "assistant", "content": ok.text or None}
        if ok.reasoning is not None:
            message["reasoning_content"] = ok.reasoning
        if ok.refusal is not None:
            message["refusal"] = ok.refusal
        if ok.tool_calls:
            message["tool_calls"] = [
                {
                    "id": tc.id or f"call_{i}",
                    "type": "function",
                    "function": {"name": tc.name, "arguments": tc.arguments},
                }
                for i, tc in enumerate(ok.tool_calls)
            ]
        answer = {
            "id": ok.response_id or f"chatcmpl-fake-{req.index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": _logprobs(ok.text_pieces()) if ok.logprobs else None,
                    "finish_reason": self._finish(ok),
                }
            ],
            "usage": self._usage(ok, len(ok.text_pieces())),
        }
        if ok.system_fingerprint is not None:
            answer["system_fingerprint"] = ok.system_fingerprint
        body = json.dumps(answer).encode()
        if ok.malformed_at is not None:
            body = b'{"id": "chatcmpl-broken", "choices": [ {"index": 0, "mess'
        return await self._send_answer(conn, req, ok, body, keep_alive)

    async def _send_answer(
        self, conn: _Conn, req: Request, ok: Ok, body: bytes, keep_alive: bool
    ) -> bool:
        """Send a whole (non-streamed) answer, or half of it for `cut_after` / `stall_after`."""
        req.status = 200
        head = self._head(200, "application/json", ok.headers, keep_alive, len(body))
        if ok.cut_after is not None or ok.stall_after is not None:
            await conn.send(head + body[: len(body) // 2])
            if ok.stall_after is not None:
                await conn.eof.wait()
                return False
            conn.close(rst=ok.rst)
            return False
        await conn.send(head + body)
        return keep_alive

    async def _stream(self, conn: _Conn, req: Request, ok: Ok, keep_alive: bool) -> bool:
        await conn.sleep(ok.delay)
        model = ok.model or req.model or "fake-model"
        rid = ok.response_id or f"chatcmpl-fake-{req.index}"
        created = int(time.time())
        opts = req.json.get("stream_options") if isinstance(req.json, dict) else None
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            text = delta.get("content")
            logprobs = _logprobs([text]) if ok.logprobs and text else None
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": ok.system_fingerprint,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                ],
            }

        # The content events, in order.
        deltas: list[dict[str, Any]] = []
        if ok.reasoning:
            deltas += [{"reasoning_content": p} for p in Ok(ok.reasoning).text_pieces()]
        if ok.refusal:
            deltas += [{"refusal": p} for p in Ok(ok.refusal).text_pieces()]
        text_pieces = ok.text_pieces()
        deltas += [{"content": p} for p in text_pieces]
        for i, tc in enumerate(ok.tool_calls):
            args = Ok(tc.arguments, chunks=tc.chunks).text_pieces() if tc.arguments else []
            first = {
                "index": i,
                "id": tc.id or f"call_{i}",
                "type": "function",
                "function": {"name": tc.name, "arguments": ""},
            }
            deltas.append({"tool_calls": [first]})
            deltas += [{"tool_calls": [{"index": i, "function": {"arguments": a}}]} for a in args]
        if not ok.role_chunk and deltas:
            deltas[0] = {"role": "assistant", **deltas[0]}

        req.status = 200
        await conn.send(self._head(200, "text/event-stream", ok.headers, keep_alive, None))
        if ok.empty_choices_first:
            empty = chunk({})
            empty["choices"] = []
            empty["prompt_filter_results"] = []
            await conn.send(_chunked(_sse(empty)))
        for _ in range(ok.keepalives):
            await conn.send(_chunked(b": keep-alive\n\n"))
        if ok.role_chunk:
            await conn.send(_chunked(_sse(chunk({"role": "assistant", "content": ""}))))
        await conn.sleep(ok.first_token_delay)

        for i, delta in enumerate(deltas):
            if await _scripted_break(conn, ok, i):
                return False
            if i > 0:
                await conn.sleep(ok.chunk_delay)
            if i == ok.paused_after and ok.resume is not None:
                while not ok.resume.is_set():
                    await conn.sleep(0.01)
            if ok.error_at is not None and i >= ok.error_at:
                await conn.send(_chunked(_sse({"error": dict(ok.error or {})})))
                await conn.send(b"0\r\n\r\n")
                return keep_alive
            req.chunks_sent += 1  # counted as it is written: see `Request.chunks_sent`
            if ok.malformed_at == i:
                await conn.send(_chunked(b'data: {"id": "chatcmpl-broken", "choices": [{\n\n'))
            else:
                await conn.send(_chunked(_sse(chunk(delta))))
        if await _scripted_break(conn, ok, len(deltas), at_end=True):
            return False
        if ok.error_at is not None:
            await conn.send(_chunked(_sse({"error": dict(ok.error or {})})))
            await conn.send(b"0\r\n\r\n")
            return keep_alive
        finish = self._finish(ok)
        if finish is not None:
            await conn.send(_chunked(_sse(chunk({}, finish))))
        if include_usage and finish is not None:
            final = chunk({})
            final["choices"] = []
            final["usage"] = self._usage(ok, len(text_pieces))
            await conn.send(_chunked(_sse(final)))
        if ok.done:
            await conn.send(_chunked(b"data: [DONE]\n\n"))
        if ok.hold_open:
            await conn.eof.wait()
            return False
        if ok.abort_at_end:
            conn.close(rst=ok.rst)
            return False
        await conn.send(b"0\r\n\r\n")
        return keep_alive
