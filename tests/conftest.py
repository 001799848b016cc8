"""Shared fixtures: the default embedding model loaded once, and a uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

# Under `pytest -n N` the workers share the machine's cores: each worker, and each process
# its tests start (a CLI, a Ray actor), runs torch on one thread, so that the workers' threads
# do not spin waiting for a core. Set before torch is first imported (it reads it then).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from chatroute.chat import EmbeddingFingerprint, EmbeddingGenerator

# The tests' upstreams listen on 127.0.0.1: a proxy set in the environment of the machine
# running them must not stand in between (tests/test_provider_proxy.py sets its own).
for _name in ("http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_name, None)
    os.environ.pop(_name.upper(), None)


def _trust_one_root() -> None:
    """Point SSL_CERT_FILE (which httpx, the SDKs' clients and the providers read) at one
    public root certificate instead of the ~150 of the full bundle.

    Every server the tests reach is on 127.0.0.1, most over plain HTTP; the TLS test brings
    its own trust. Each HTTP client made loads its CA file: 21-27 ms of CPU for the bundle,
    1.5 ms for one certificate, and the suite makes a couple of hundred clients. So this is
    done even where the machine sets SSL_CERT_FILE or SSL_CERT_DIR itself (CI images often
    point them at the full system bundle); a process that inherits the file keeps it.
    """
    import atexit
    import re
    import tempfile

    import certifi

    bundle = Path(certifi.where()).read_text(encoding="ascii")
    first = re.search(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\n", bundle, re.S)
    if first is None:
        return
    fd, name = tempfile.mkstemp(prefix="chatroute-tests-", suffix=".pem")
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        fh.write(first.group(0))
    atexit.register(os.unlink, name)
    os.environ["SSL_CERT_FILE"] = name
    os.environ.pop("SSL_CERT_DIR", None)


_inherited = Path(os.environ.get("SSL_CERT_FILE", ""))
if not (_inherited.name.startswith("chatroute-tests-") and _inherited.is_file()):
    _trust_one_root()


class BorrowedEmbedder(EmbeddingGenerator):
    """Lends a shared generator to code that closes what it is given: `aclose` is a no-op."""

    def __init__(self, inner: EmbeddingGenerator) -> None:
        self.inner = inner

    @property
    def fingerprint(self) -> EmbeddingFingerprint | None:
        return self.inner.fingerprint

    async def generate(self, values: Sequence[str]) -> np.ndarray:
        return await self.inner.generate(values)

    def __getattr__(self, name: str) -> Any:  # queue_depth, add_batch_listener, device, ...
        return getattr(self.inner, name)


# The test files that take longest (model loads in subprocesses and Ray actors, real
# waits), run first: the workers of `pytest -n` take files in collection order, so a long
# file started last would keep one worker busy after the other has finished. The Ray file
# is longest by far (two Ray runs, each starting an actor that loads the model): one
# worker spends much of the run on it while the others take the rest in this order.
_LONGEST_FIRST = (
    "test_classify_ray.py",
    "test_serve_process.py",
    "test_classify.py",
    "test_fault_matrix.py",
    "test_embedder.py",
    "test_load.py",
    "test_check.py",
    "test_fuzz_openapi.py",
    "test_disconnect.py",
    "test_fake_upstream.py",
    "test_reload.py",
    "test_provider_faults.py",
    "test_shared_state.py",
    "test_public_api.py",
    "test_provider_hostile.py",
    "test_server_embeddings.py",
    "test_server_sessions.py",
    "test_default_timeouts.py",
    "test_server_http.py",
    "test_cli_remote.py",
)


def _compile_for_the_workers(config: pytest.Config) -> None:
    """Write the bytecode every worker of `pytest -n` would otherwise compile for itself.

    On a fresh checkout each worker rewrites the asserts of all 60-odd test modules (about
    3 s of CPU a worker) and compiles the package: with three workers, three times over on
    two cores. Done once here, the workers read it; the files are written as pytest writes
    them (a complete file renamed into place), so a worker that gets there first is
    harmless. pytest's rewriting internals are private: if they move, the workers simply
    compile for themselves again.
    """
    import compileall

    try:
        from _pytest.assertion.rewrite import (
            PYC_TAIL,
            _read_pyc,
            _rewrite_test,
            _write_pyc,
            assertstate_key,
            get_cache_dir,
            try_makedirs,
        )

        state = config.stash[assertstate_key]
    except (ImportError, KeyError):
        state = None
    root = Path(__file__).parent
    compileall.compile_dir(root.parent / "chatroute", quiet=1)
    for path in sorted(root.rglob("*.py")):
        if path.name == "conftest.py":
            continue  # imported (and rewritten) by this process already
        if not path.name.startswith("test_"):
            compileall.compile_file(path, quiet=1)  # helpers, imported as plain modules
        elif state is not None:
            cache = get_cache_dir(path)
            pyc = cache / (path.name[:-3] + PYC_TAIL)
            if try_makedirs(cache) and _read_pyc(path, pyc) is None:
                source_hash, code = _rewrite_test(path, config)
                _write_pyc(state, code, source_hash, pyc)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under `pytest -n`, compile the test modules once, beside the workers' start-up."""
    config = session.config
    controller = not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
    if controller and not sys.dont_write_bytecode and config.getoption("assertmode") == "rewrite":
        threading.Thread(target=_compile_for_the_workers, args=(config,), daemon=True).start()


@contextlib.contextmanager
def _imports_out_of_the_collectors_reach() -> Iterator[None]:
    """Pause the cyclic garbage collector while a block imports and loads, then freeze what
    it built (`gc.freeze`, as `chatroute serve` does after start-up).

    Importing torch, transformers and the test modules grows the heap by about a million
    objects, and the collector runs a full collection, each scanning all of them, every
    time it has grown by a quarter: 2.5-3 s of CPU a worker, spent on objects that live
    as long as the process. Imports leave next to no cyclic garbage behind.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """Collect (import every test module) with the collector paused, then freeze."""
    with _imports_out_of_the_collectors_reach():
        return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files longest first (see `_LONGEST_FIRST`); tests keep their order in a file."""
    rank = {name: n for n, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _chatroute_logging() -> Iterator[None]:
    """Undo the logging set-up an in-process `chatroute serve` makes (a handler, a level,
    no propagation), so it does not outlive its test."""
    target = logging.getLogger("chatroute")
    handlers, level, propagate = list(target.handlers), target.level, target.propagate
    yield
    target.handlers[:] = handlers
    if target.level != level:  # setLevel clears the cache of every logger (thousands here)
        target.setLevel(level)
    target.propagate = propagate


@pytest.fixture(scope="session")
def default_embedder() -> Iterator[Callable[[], EmbeddingGenerator]]:
    """A factory of borrowed handles on one real default-model embedder (loaded on first use)."""
    loaded: list[Any] = []

    def borrow() -> EmbeddingGenerator:
        if not loaded:
            with _imports_out_of_the_collectors_reach():
                from chatroute.embedder import SentenceTransformerEmbedder

                loaded.append(SentenceTransformerEmbedder("default", device="cpu"))
        return BorrowedEmbedder(loaded[0])

    yield borrow
    for embedder in loaded:
        embedder.close()


@pytest.fixture(scope="module")
def runner(default_embedder: Callable[[], EmbeddingGenerator]) -> Any:
    """The loaded default model's `ModelRunner`, shared with `default_embedder` (loaded once)."""
    from chatroute.embedder import SentenceTransformerEmbedder

    shared = default_embedder()
    inner: Any = getattr(shared, "inner", shared)
    assert isinstance(inner, SentenceTransformerEmbedder)
    return inner._runner


@pytest.fixture
def make(runner: Any) -> Iterator[Callable[..., Any]]:
    """Embedders over the shared model with their own queue settings; closed after the test."""
    from chatroute.embedder import SentenceTransformerEmbedder

    made: list[SentenceTransformerEmbedder] = []

    def build(**kwargs: Any) -> SentenceTransformerEmbedder:
        emb = SentenceTransformerEmbedder(_runner=runner, warmup=False, **kwargs)
        made.append(emb)
        return emb

    yield build
    for emb in made:
        emb.close()


@pytest.fixture
def config_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    default_embedder: Callable[[], EmbeddingGenerator],
) -> Path:
    """The CLI tests' config (`classify_helpers.CONFIG`) in a file; every engine a command
    builds borrows the session's model instead of loading its own."""
    from classify_helpers import CONFIG

    monkeypatch.setattr("chatroute.engine.build_embedder", lambda config: default_embedder())
    path = tmp_path / "chatroute.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return path


def _prompt_server(config: Any) -> Any:
    """A `uvicorn.Server` that starts and stops as soon as it can, for tests that start many.

    uvicorn looks for a stop request every 100 ms and, once stopping, waits another fixed
    100 ms and then polls its connections every 100 ms: about 0.2 s a server, times every
    server the suite starts. This one is woken by `stop()` and polls every 5 ms; the rest
    of its stopping (closing the listener and the connections, waiting for answers in flight
    up to `timeout_graceful_shutdown`, the app's lifespan shutdown) is uvicorn's order.
    """
    import asyncio

    import uvicorn

    class PromptServer(uvicorn.Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            self.ready = threading.Event()
            self._wake: asyncio.Event | None = None
            self._loop: asyncio.AbstractEventLoop | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            await super().startup(sockets)
            self.ready.set()

        async def main_loop(self) -> None:
            assert self._wake is not None
            counter = 0
            while not await self.on_tick(counter):
                counter = (counter + 1) % 864_000
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.1)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            for listener in self.servers:
                listener.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()
            state = self.server_state
            try:
                async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                    while state.connections or state.tasks:
                        await asyncio.sleep(0.005)
            except TimeoutError:
                for task in state.tasks:
                    task.cancel()
            for listener in self.servers:
                await listener.wait_closed()
            await self.lifespan.shutdown()

        def stop(self) -> None:
            self.should_exit = True
            loop, wake = self._loop, self._wake
            if loop is not None and wake is not None:
                with contextlib.suppress(RuntimeError):  # the loop has already ended
                    loop.call_soon_threadsafe(wake.set)

    return PromptServer(config)


@contextlib.contextmanager
def _serve(app: Any, timeout: float = 60.0, head_timeout: float = 10.0) -> Iterator[str]:
    import uvicorn

    from chatroute.server.connection import http_protocol

    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Keep-alive longer than the clients' own idle expiry (httpx: 5 s), so that a client never
    # reuses a connection the server is closing at that very moment.
    # The HTTP protocol `chatroute serve` runs.
    config = uvicorn.Config(
        app,
        http=http_protocol(head_timeout),
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )
    server = _prompt_server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.ready.wait(0.05):
        if not thread.is_alive():
            raise RuntimeError("the server under test failed to start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server under test did not start within {timeout} s")
    if not server.started:  # its start-up failed (the app's lifespan start-up, the socket)
        thread.join(10)
        raise RuntimeError("the server under test failed to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def serve_app() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`with serve_app(app) as url:` runs an ASGI app under uvicorn on 127.0.0.1 (any port)."""
    return _serve


# ------------------------------------------------------------------ the service on fakes


class ServiceStack:
    """The real service under uvicorn on 127.0.0.1, in front of scripted fake upstreams.

    `upstreams` maps provider names to their `FakeUpstream`; `traces` collects the
    `RequestTrace` of every finished chat request (the app's trace sink), in order.
    """

    def __init__(self, url: str, app: Any, upstreams: dict[str, Any], key: str) -> None:
        import httpx
        import openai

        self.url = url
        self.app = app
        self.upstreams = upstreams
        self.key = key
        self.traces: list[Any] = []
        self._changed = threading.Condition()
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        self.http = httpx.Client(
            base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30.0
        )

    def sink(self, trace: Any) -> None:
        """The app's trace sink (runs on the server's thread)."""
        with self._changed:
            self.traces.append(trace)
            self._changed.notify_all()

    def wait_traces(self, n: int, timeout: float = 5.0) -> list[Any]:
        """Block until at least `n` chat requests have finished; return their traces."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.traces) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only {len(self.traces)} of {n} requests finished")
                self._changed.wait(left)
            return list(self.traces)

    @property
    def service(self) -> Any:
        """The running `Service` (engine, metrics)."""
        return self.app.state.service

    def reset(self) -> None:
        """Forget scripts, records and traces; every upstream healthy, every breaker closed."""
        from tests.fakes import Ok

        for up in self.upstreams.values():
            up.reset()
            up.handler = None
            up.default = Ok("Hello from the fake upstream.")
        for breaker in self.service.engine.breakers:
            breaker.reset()
        with self._changed:
            self.traces.clear()

    def attempts(self) -> dict[str, int]:
        """Chat requests each upstream received."""
        return {name: up.attempts for name, up in self.upstreams.items()}

    def metrics(self) -> str:
        """The /metrics exposition text."""
        return str(self.http.get("/metrics").text)

    def close(self) -> None:
        self.client.close()
        self.http.close()


@contextlib.contextmanager
def _stack(
    build_config: Callable[[dict[str, str]], dict[str, Any]],
    names: Sequence[str],
    embedder: EmbeddingGenerator,
) -> Iterator[ServiceStack]:
    from chatroute.config import parse_config
    from chatroute.server import create_app
    from tests.fakes import FakeUpstream

    key = "stack-key-0123456789"
    with contextlib.ExitStack() as stack:
        upstreams = {name: stack.enter_context(FakeUpstream()) for name in names}
        data = build_config({name: up.base_url for name, up in upstreams.items()})
        config = parse_config(data, environ={})
        made: list[ServiceStack] = []

        def sink(trace: Any) -> None:
            made[0].sink(trace)

        app = create_app(config, api_keys=[key], environ={}, embedder=embedder, trace_sink=sink)
        url = stack.enter_context(_serve(app))
        made.append(ServiceStack(url, app, upstreams, key))
        try:
            yield made[0]
        finally:
            made[0].close()


@pytest.fixture(scope="module")
def service_stack(
    default_embedder: Callable[[], EmbeddingGenerator],
) -> Callable[..., contextlib.AbstractContextManager[ServiceStack]]:
    """`with service_stack(build_config, ["primary", "fallback"]) as stack:` runs the real
    service (uvicorn, 127.0.0.1) in front of one `FakeUpstream` per name.

    `build_config(base_urls)` returns the config mapping; the shared default-model
    embedder is lent to it.
    """

    def make(
        build_config: Callable[[dict[str, str]], dict[str, Any]], names: Sequence[str]
    ) -> contextlib.AbstractContextManager[ServiceStack]:
        return _stack(build_config, names, default_embedder())

    return make
