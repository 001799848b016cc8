"""Shared fixtures: the default embedding model loaded once, and a uvicorn server in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from chatroute.chat import EmbeddingFingerprint, EmbeddingGenerator


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


@pytest.fixture(scope="session")
def default_embedder() -> Iterator[Callable[[], EmbeddingGenerator]]:
    """A factory of borrowed handles on one real default-model embedder (loaded on first use)."""
    loaded: list[Any] = []

    def borrow() -> EmbeddingGenerator:
        if not loaded:
            from chatroute.embedder import SentenceTransformerEmbedder

            loaded.append(SentenceTransformerEmbedder("default", device="cpu"))
        return BorrowedEmbedder(loaded[0])

    yield borrow
    for embedder in loaded:
        embedder.close()


@contextlib.contextmanager
def _serve(app: Any, timeout: float = 60.0) -> Iterator[str]:
    import uvicorn

    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server under test failed to start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server under test did not start within {timeout} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def serve_app() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """`with serve_app(app) as url:` runs an ASGI app under uvicorn on 127.0.0.1 (any port)."""
    return _serve
