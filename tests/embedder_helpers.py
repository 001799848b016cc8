"""Test helpers for the embedder: a gate that holds forward passes, and condition polling."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from chatroute.embedder import SentenceTransformerEmbedder
from chatroute.embedder._batcher import Batch


class ForwardGate:
    """Holds the first `hold` forward passes of an embedder until `open()`; records batches."""

    def __init__(
        self, emb: SentenceTransformerEmbedder, monkeypatch: pytest.MonkeyPatch, hold: int = 1
    ) -> None:
        self.started = threading.Event()
        self._release = threading.Event()
        self.sizes: list[int] = []
        self._hold = hold
        original = emb._runner.launch

        def launch(batch: Batch) -> Any:
            self.sizes.append(batch.size)
            if len(self.sizes) <= self._hold:
                self.started.set()
                self._release.wait(60)
            return original(batch)

        monkeypatch.setattr(emb._runner, "launch", launch)

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 60), "no forward pass started"

    def open(self) -> None:
        self._release.set()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition` on the event loop (not a timing assertion: only a hang guard)."""
    for _ in range(6000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for: {what}")
