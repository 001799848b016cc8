"""Local, micro-batched sentence-transformer embeddings (the routing engine's embedder)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from chatroute.embedder.errors import (
    EmbedderClosedError,
    EmbedderLoadError,
    EmbedderOverloadedError,
)

if TYPE_CHECKING:
    from chatroute.embedder.sentence_transformer import BatchListener, SentenceTransformerEmbedder

__all__ = [
    "BatchListener",
    "EmbedderClosedError",
    "EmbedderLoadError",
    "EmbedderOverloadedError",
    "SentenceTransformerEmbedder",
]

# The embedder resolves on first use: importing chatroute (a CLI command that asks a
# running service, a Ray worker unpickling a function) does not import torch.
_LAZY = frozenset({"BatchListener", "SentenceTransformerEmbedder"})


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'chatroute.embedder' has no attribute {name!r}")
    value = getattr(importlib.import_module("chatroute.embedder.sentence_transformer"), name)
    globals()[name] = value
    return value
