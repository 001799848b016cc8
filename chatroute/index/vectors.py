"""Validation and L2 normalisation of embedding matrices returned by generators."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from chatroute.index.errors import InvalidEmbeddingError

__all__ = ["as_embedding_matrix", "l2_normalize_rows"]

Float32Array = npt.NDArray[np.float32]

# Rows normalised per chunk, so that the float64 scratch space stays small for big banks.
_NORMALIZE_CHUNK_ROWS = 8192


def as_embedding_matrix(
    raw: Any,
    *,
    rows: int,
    dimension: int | None = None,
    what: str = "embedding",
    allow_zero_rows: bool = False,
) -> Float32Array:
    """Check a generator's result and return it as a C-contiguous float32 (rows, d) array.

    The result shares memory with `raw` when `raw` already is such an array; neither is
    modified here, and callers must not modify the result.

    Raises `InvalidEmbeddingError` (a RuntimeError) when the result is not a finite numeric
    matrix of `rows` rows with `dimension` columns (any d >= 1 when `dimension` is None), or,
    unless `allow_zero_rows`, when a row is all zeros.
    """
    if raw is None:
        raise InvalidEmbeddingError(f"the embedding generator returned None for the {what}s")
    raw = _to_host(raw)
    try:
        array = np.ascontiguousarray(raw, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidEmbeddingError(
            f"the {what} embeddings could not be read as a float32 matrix: {exc}"
        ) from exc
    if array.ndim != 2:
        raise InvalidEmbeddingError(
            f"expected a 2-D {what} embedding matrix of {rows} rows, got shape {array.shape}"
        )
    if array.shape[0] != rows:
        raise InvalidEmbeddingError(
            f"expected {rows} {what} embedding(s), the generator returned {array.shape[0]}"
        )
    if array.shape[1] < 1:
        raise InvalidEmbeddingError(f"the {what} embeddings have dimension 0")
    if dimension is not None and array.shape[1] != dimension:
        raise InvalidEmbeddingError(
            f"expected {what} embeddings of dimension {dimension}, got {array.shape[1]}"
        )
    if not np.isfinite(array).all():
        raise InvalidEmbeddingError(f"the {what} embeddings contain NaN or infinite values")
    if not allow_zero_rows:
        zero = ~array.any(axis=1)
        if zero.any():
            first = int(np.flatnonzero(zero)[0])
            raise InvalidEmbeddingError(
                f"{what} embedding {first} is all zeros and has no direction to compare"
            )
    return array


def l2_normalize_rows(matrix: Float32Array) -> tuple[Float32Array, npt.NDArray[np.float64]]:
    """Return (a new float32 matrix with unit-norm rows, the float64 row norms).

    Norms are computed in float64 so that tiny vectors do not underflow; all-zero rows
    stay zero (their norm is 0).
    """
    out = np.zeros(matrix.shape, dtype=np.float32)
    norms = np.zeros(matrix.shape[0], dtype=np.float64)
    for start in range(0, matrix.shape[0], _NORMALIZE_CHUNK_ROWS):
        chunk = matrix[start : start + _NORMALIZE_CHUNK_ROWS].astype(np.float64)
        chunk_norms = np.sqrt(np.einsum("ij,ij->i", chunk, chunk))
        norms[start : start + chunk.shape[0]] = chunk_norms
        safe = np.where(chunk_norms > 0.0, chunk_norms, 1.0)
        out[start : start + chunk.shape[0]] = (chunk / safe[:, None]).astype(np.float32)
    return out, norms


def _to_host(raw: Any) -> Any:
    """Bring a torch tensor (possibly on a GPU, possibly half precision) to a host array."""
    if type(raw).__module__.split(".")[0] == "torch" and hasattr(raw, "detach"):
        return raw.detach().float().cpu().numpy()
    return raw
