"""Test doubles for semantic routing: a vector-table embedding generator and recording clients."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    EmbeddingFingerprint,
    EmbeddingGenerator,
    TextContent,
)


class FakeEmbeddingGenerator(EmbeddingGenerator):
    """Looks each text up in a table of hand-made vectors and records every call.

    - `calls`: the list of texts of each `generate` call, in order.
    - `fail_next`: exceptions raised by the next calls, one per call, before any lookup.
    - `gate`: when set, every call waits for it before answering (to hold builds open).
    - `transform`: applied to the result matrix (to return malformed output).
    """

    def __init__(
        self,
        table: Mapping[str, Sequence[float]],
        *,
        fingerprint: EmbeddingFingerprint | None = None,
        default: Sequence[float] | None = None,
    ) -> None:
        self.table = {text: np.asarray(vec, dtype=np.float32) for text, vec in table.items()}
        self.default = None if default is None else np.asarray(default, dtype=np.float32)
        self._fingerprint = fingerprint
        self.calls: list[list[str]] = []
        self.fail_next: list[BaseException] = []
        self.gate: asyncio.Event | None = None
        self.transform: Callable[[np.ndarray], Any] | None = None
        self.close_count = 0
        self.close_error: BaseException | None = None
        self.returned: list[Any] = []

    @property
    def fingerprint(self) -> EmbeddingFingerprint | None:
        return self._fingerprint

    async def generate(self, values: Sequence[str]) -> np.ndarray:
        texts = list(values)
        self.calls.append(texts)
        if self.gate is not None:
            await self.gate.wait()
        else:
            await asyncio.sleep(0)
        if self.fail_next:
            raise self.fail_next.pop(0)
        rows = [self._lookup(text) for text in texts]
        dim = len(next(iter(self.table.values())))
        matrix = np.stack(rows) if rows else np.zeros((0, dim), dtype=np.float32)
        result = self.transform(matrix) if self.transform is not None else matrix
        self.returned.append(result)
        return result  # type: ignore[no-any-return]

    def _lookup(self, text: str) -> np.ndarray:
        if text in self.table:
            return self.table[text].copy()
        if self.default is not None:
            return self.default.copy()
        raise KeyError(f"no vector for {text!r}")

    async def aclose(self) -> None:
        self.close_count += 1
        if self.close_error is not None:
            raise self.close_error

    @property
    def texts_embedded(self) -> list[str]:
        """Every text sent to the generator, over all calls."""
        return [text for call in self.calls for text in call]


class BagOfWordsEmbedder(EmbeddingGenerator):
    """Deterministic hashed bag-of-words vectors; counts its generate calls.

    `delay`: seconds each call takes (on the event loop), for runs that must last a while.
    """

    def __init__(self, dim: int = 256, delay: float = 0.0) -> None:
        self.dim = dim
        self.delay = delay
        self.calls: list[list[str]] = []
        self.closed = False

    async def generate(self, values: Sequence[str]) -> np.ndarray:
        self.calls.append(list(values))
        if self.delay:
            await asyncio.sleep(self.delay)
        out = np.zeros((len(values), self.dim), dtype=np.float32)
        for row, text in enumerate(values):
            for word in re.findall(r"[a-z]+", text.lower()):
                digest = hashlib.sha256(word.encode()).digest()
                out[row, int.from_bytes(digest[:4], "little") % self.dim] += 1.0
        return out

    async def aclose(self) -> None:
        self.closed = True


class NamedClient(ChatClient):
    """Answers with its own name and records the messages and options it was called with."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: list[tuple[Sequence[ChatMessage], ChatOptions | None]] = []
        self.stream_requests: list[tuple[Sequence[ChatMessage], ChatOptions | None]] = []
        self.close_count = 0
        self.close_error: BaseException | None = None

    def __repr__(self) -> str:
        return f"NamedClient({self.name!r})"

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        self.requests.append((messages, options))
        return ChatResponse(messages=[ChatMessage(ChatRole.ASSISTANT, self.name)])

    async def _stream(self) -> AsyncIterator[ChatResponseUpdate]:
        for part in (self.name, "!"):
            yield ChatResponseUpdate(role=ChatRole.ASSISTANT, contents=[TextContent(part)])

    def get_streaming_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        self.stream_requests.append((messages, options))
        return self._stream()

    async def aclose(self) -> None:
        self.close_count += 1
        if self.close_error is not None:
            raise self.close_error


def user(text: str) -> list[ChatMessage]:
    """A one-message conversation from the user."""
    return [ChatMessage(ChatRole.USER, text)]


FINGERPRINT = EmbeddingFingerprint(
    model="fake-model", weights_sha256="0" * 64, dimension=2, normalized=True
)
