"""Errors raised by the profile index: bad embeddings, unreadable files, model mismatches."""

from __future__ import annotations

__all__ = [
    "FingerprintMismatchError",
    "IndexFormatError",
    "InvalidEmbeddingError",
    "ProfileIndexError",
]


class ProfileIndexError(RuntimeError):
    """Base class of the profile index's own errors."""


class InvalidEmbeddingError(ProfileIndexError):
    """An embedding generator returned a matrix of the wrong shape, non-finite or zero rows."""


class IndexFormatError(ProfileIndexError):
    """A saved profile index is missing, corrupt or written in an unsupported format."""


class FingerprintMismatchError(ProfileIndexError):
    """A saved profile index was built by another embedding model than the one offered."""
