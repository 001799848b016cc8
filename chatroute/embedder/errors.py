"""Typed errors raised by the local embedder."""

from __future__ import annotations

__all__ = ["EmbedderClosedError", "EmbedderLoadError", "EmbedderOverloadedError"]


class EmbedderLoadError(RuntimeError):
    """The embedding model could not be loaded (the message names it and the offline state)."""


class EmbedderOverloadedError(RuntimeError):
    """The embedder's bounded queue is full: the request was refused, not queued."""


class EmbedderClosedError(RuntimeError):
    """The embedder was closed before, or while, the request was being served."""
