"""The profile index: exact cosine top-K over route utterances, on CPU or GPU, persistable."""

from chatroute.index.errors import (
    FingerprintMismatchError,
    IndexFormatError,
    InvalidEmbeddingError,
    ProfileIndexError,
)
from chatroute.index.profile_index import Backend, ProfileIndex
from chatroute.index.vectors import as_embedding_matrix, l2_normalize_rows

__all__ = [
    "Backend",
    "FingerprintMismatchError",
    "IndexFormatError",
    "InvalidEmbeddingError",
    "ProfileIndex",
    "ProfileIndexError",
    "as_embedding_matrix",
    "l2_normalize_rows",
]
