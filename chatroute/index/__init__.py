"""The profile index: exact cosine top-K over route utterances, on CPU or GPU, persistable."""

from chatroute.index.errors import (
    FingerprintMismatchError,
    IndexFormatError,
    InvalidEmbeddingError,
    ProfileIndexError,
)
from chatroute.index.head import HeadTrainer, TrainedHead, head_key, route_groups
from chatroute.index.profile_index import Backend, ProfileIndex
from chatroute.index.vectors import as_embedding_matrix, l2_normalize_rows

__all__ = [
    "Backend",
    "FingerprintMismatchError",
    "HeadTrainer",
    "IndexFormatError",
    "InvalidEmbeddingError",
    "ProfileIndex",
    "ProfileIndexError",
    "TrainedHead",
    "as_embedding_matrix",
    "head_key",
    "l2_normalize_rows",
    "route_groups",
]
