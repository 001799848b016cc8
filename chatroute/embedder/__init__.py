"""Local, micro-batched sentence-transformer embeddings (the routing engine's embedder)."""

from chatroute.embedder.errors import (
    EmbedderClosedError,
    EmbedderLoadError,
    EmbedderOverloadedError,
)
from chatroute.embedder.sentence_transformer import BatchListener, SentenceTransformerEmbedder

__all__ = [
    "BatchListener",
    "EmbedderClosedError",
    "EmbedderLoadError",
    "EmbedderOverloadedError",
    "SentenceTransformerEmbedder",
]
