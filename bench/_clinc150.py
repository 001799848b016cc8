"""Shared CLINC150 routing setup: stand-in route clients, the data split, an embedding cache,
calibrated routers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from chatroute import (
    CalibrationResult,
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    EmbeddingGenerator,
    SemanticRoutingChatClient,
    calibrate,
)

PROFILE_SIZE = 20


class RouteClient(ChatClient):
    """A stand-in route target: the benchmark only asks for decisions."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        raise NotImplementedError

    def get_streaming_response(self, messages: Any, options: Any = None) -> Any:
        raise NotImplementedError


def split(data: dict[str, list[tuple[str, str]]]) -> dict[str, Any]:
    profiles: dict[str, list[str]] = {}
    fit_train: list[tuple[str, str | None]] = []
    for text, intent in data["train"]:
        bucket = profiles.setdefault(intent, [])
        if len(bucket) < PROFILE_SIZE:
            bucket.append(text)
        else:
            fit_train.append((text, intent))
    fit = fit_train + [(t, i) for t, i in data["val"]] + [(t, None) for t, _ in data["oos_val"]]
    queries = [(t, i) for t, i in data["test"]] + [(t, None) for t, _ in data["oos_test"]]
    val = [(t, i) for t, i in data["val"]] + [(t, None) for t, _ in data["oos_val"]]
    return {"profiles": profiles, "fit": fit, "val": val, "queries": queries}


class CachedGenerator(EmbeddingGenerator):
    """Memoises another generator per text, so accuracy runs of several configurations
    embed each text once (throughput is always measured without it)."""

    def __init__(self, inner: EmbeddingGenerator) -> None:
        self.inner = inner
        self.cache: dict[str, np.ndarray] = {}

    async def generate(self, values: Sequence[str]) -> np.ndarray:
        missing = list(dict.fromkeys(v for v in values if v not in self.cache))
        if missing:
            vectors = await self.inner.generate(missing)
            self.cache.update(zip(missing, vectors, strict=True))
        return np.stack([self.cache[v] for v in values]).astype(np.float32)


async def calibrated(
    generator: EmbeddingGenerator,
    profiles: Mapping[ChatClient, list[str]],
    default: ChatClient,
    scoring: str,
    val: Sequence[tuple[str, str | None]],
    clients: Mapping[str, ChatClient],
    **settings: Any,
) -> tuple[SemanticRoutingChatClient, CalibrationResult, SemanticRoutingChatClient]:
    """A router of `scoring` (with `settings`), the thresholds `calibrate()` fits for it on
    `val`, and a router on the same profile index deciding with those thresholds."""
    router = SemanticRoutingChatClient(generator, profiles, default, scoring=scoring, **settings)
    await router.prepare()
    fitted = await calibrate(router, val, clients)
    settings.pop("score_threshold", None)
    tuned = SemanticRoutingChatClient(
        generator,
        profiles,
        default,
        scoring=fitted.scoring,
        route_thresholds=fitted.thresholds,
        profile_index=router.profile_index,
        **settings,
    )
    return router, fitted, tuned
