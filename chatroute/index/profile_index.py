"""ProfileIndex: exact cosine top-K over the profile utterances, with save, load and rebuild."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from chatroute.chat.embedding import EmbeddingFingerprint, EmbeddingGenerator
from chatroute.index.backends import (
    FaissCpuBackend,
    FaissGpuBackend,
    SearchBackend,
    TorchBackend,
    faiss_has_gpu,
)
from chatroute.index.errors import FingerprintMismatchError, IndexFormatError
from chatroute.index.head import HeadTrainer, TrainedHead, head_key, route_groups
from chatroute.index.vectors import as_embedding_matrix, l2_normalize_rows

__all__ = ["Backend", "ProfileIndex"]

Float32Array = npt.NDArray[np.float32]
Int64Array = npt.NDArray[np.int64]
Backend = Literal["auto", "faiss", "faiss-gpu", "torch"]

_FORMAT = "chatroute-profile-index"
_FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_VECTORS = "vectors.npy"
_HEAD = "head.npz"
logger = logging.getLogger("chatroute.index")

# Extra candidates fetched beyond k, so that a tie at the k-th score rarely needs a re-search.
_MIN_MARGIN = 32


class ProfileIndex:
    """Exact cosine similarity search over a bank of profile vectors.

    The rows are copied to float32 and L2-normalised, then searched by inner product in a
    FAISS `IndexFlatIP` (on the CPU, or on a GPU when `device` is CUDA and faiss has GPU
    support) or by an exact torch matmul on `device`. Whatever the backend, `search`
    ranks by score, descending, and breaks ties by the lower profile id, exactly, the
    top-k boundary included.

    `utterances`, `labels` (route names) and `fingerprint` (the embedding model that made
    the vectors) are optional metadata; `save` needs the utterances and the fingerprint.
    `head` is the trained scoring head kept with the index (see `trained`), saved and
    loaded with it.
    """

    def __init__(
        self,
        vectors: npt.ArrayLike,
        *,
        utterances: Sequence[str] | None = None,
        labels: Sequence[str] | None = None,
        fingerprint: EmbeddingFingerprint | None = None,
        device: str | None = None,
        backend: Backend = "auto",
        head: TrainedHead | None = None,
        _normalized: bool = False,
    ) -> None:
        matrix = np.asarray(vectors, dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[0] < 1 or matrix.shape[1] < 1:
            raise ValueError(f"profile vectors must be a non-empty 2-D matrix, got {matrix.shape}")
        if not np.isfinite(matrix).all():
            raise ValueError("profile vectors contain NaN or infinite values")
        if not matrix.any(axis=1).all():
            raise ValueError("a profile vector is all zeros")
        if not _normalized:
            matrix, _ = l2_normalize_rows(matrix)  # a new array: the caller's is never kept
        matrix = np.ascontiguousarray(matrix)
        matrix.setflags(write=False)
        count, dimension = matrix.shape
        self._utterances = _check_texts(utterances, count, "utterances")
        self._labels = _check_texts(labels, count, "labels")
        if fingerprint is not None:
            if not isinstance(fingerprint, EmbeddingFingerprint):
                raise TypeError("fingerprint must be an EmbeddingFingerprint")
            if fingerprint.dimension != dimension:
                raise ValueError(
                    f"the fingerprint says dimension {fingerprint.dimension}, "
                    f"the vectors have {dimension}"
                )
        if head is not None and not isinstance(head, TrainedHead):
            raise TypeError("head must be a TrainedHead")
        self._head = head
        self._fingerprint = fingerprint
        self._vectors = matrix
        self._device = _resolve_device(device)
        self._backend = _make_backend(matrix, self._device, backend)

    # -- properties -----------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._vectors.shape[0])

    def __repr__(self) -> str:
        return (
            f"ProfileIndex(size={len(self)}, dimension={self.dimension}, "
            f"backend={self.backend!r}, device={self.device!r})"
        )

    @property
    def dimension(self) -> int:
        """The vector dimension d."""
        return int(self._vectors.shape[1])

    @property
    def vectors(self) -> Float32Array:
        """The L2-normalised float32 profile matrix (read-only)."""
        return self._vectors

    @property
    def utterances(self) -> tuple[str, ...] | None:
        """The utterance of each row, when known."""
        return self._utterances

    @property
    def labels(self) -> tuple[str, ...] | None:
        """The route name of each row, when known."""
        return self._labels

    @property
    def fingerprint(self) -> EmbeddingFingerprint | None:
        """The embedding model that made the vectors, when known."""
        return self._fingerprint

    @property
    def head(self) -> TrainedHead | None:
        """The trained scoring head kept with the index, if any."""
        return self._head

    @property
    def train_seconds(self) -> float | None:
        """How long training the head took (None without a head)."""
        return None if self._head is None else self._head.train_seconds

    def with_head(self, head: TrainedHead | None) -> ProfileIndex:
        """This index with `head` instead of its own (the vectors and search are shared)."""
        if head is not None and not isinstance(head, TrainedHead):
            raise TypeError("head must be a TrainedHead")
        other = copy.copy(self)
        other._head = head
        return other

    def trained(self, trainer: HeadTrainer, groups: npt.ArrayLike | None = None) -> ProfileIndex:
        """This index with a head trained by `trainer`, reusing its own when the key matches.

        `groups[i]` is the route column of row i (by default: the labels, numbered in order
        of first appearance). A head made with other settings, other vectors or other
        groups is never reused: it is retrained, and the retraining is logged.
        """
        if not trainer.trains:
            return self if self._head is None else self.with_head(None)
        if groups is None:
            if self._labels is None:
                raise ValueError("training a head needs the labels or explicit route groups")
            groups = route_groups(self._labels)
        columns = np.ascontiguousarray(groups, dtype=np.int64)
        if columns.shape != (len(self),):
            raise ValueError(f"{columns.shape[0]} route groups for {len(self)} profile rows")
        key = head_key(trainer, self._vectors, columns)
        if self._head is not None and self._head.key == key:
            return self
        if self._head is not None:
            logger.warning(
                "the saved %r scoring head was trained on other profiles or settings; "
                "retraining a %r head",
                self._head.mode,
                trainer.name,
            )
        started = time.perf_counter()
        head = trainer.train(self._vectors, columns, key)
        elapsed = time.perf_counter() - started
        head = TrainedHead(head.mode, dict(head.settings), key, dict(head.arrays), elapsed)
        logger.info("trained the %r scoring head in %.3f s", head.mode, elapsed)
        return self.with_head(head)

    @property
    def device(self) -> str:
        """The device searches run on ("cpu", "cuda:0", ...)."""
        return self._device

    @property
    def backend(self) -> str:
        """The search backend in use: "faiss", "faiss-gpu" or "torch"."""
        return self._backend.name

    # -- search ---------------------------------------------------------------------------

    def search(
        self, queries: Any, k: int, *, normalized: bool = False
    ) -> tuple[Float32Array, Int64Array]:
        """Top-`k` profiles for each query row: (scores, ids), each of shape (m, min(k, size)).

        Rows are ordered by score, descending, ties going to the lower profile id. Queries
        are L2-normalised first unless `normalized` says they already are (all-zero rows
        then score 0 everywhere). A torch tensor is accepted as well as an array.
        """
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError("k must be an int")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        is_tensor = type(queries).__module__.split(".")[0] == "torch"
        if is_tensor:
            shape = tuple(queries.shape)
        else:
            queries = np.asarray(queries, dtype=np.float32)
            shape = queries.shape
        if len(shape) != 2 or shape[1] != self.dimension:
            raise ValueError(f"queries must have shape (m, {self.dimension}), got {tuple(shape)}")
        if not normalized:
            if is_tensor:
                queries = queries.detach().float().cpu().numpy()
            queries, _ = l2_normalize_rows(np.ascontiguousarray(queries, dtype=np.float32))
        return self._exact_topk(queries, min(k, len(self)), int(shape[0]))

    def _exact_topk(self, queries: Any, k: int, m: int) -> tuple[Float32Array, Int64Array]:
        n = len(self)
        out_scores = np.empty((m, k), dtype=np.float32)
        out_ids = np.empty((m, k), dtype=np.int64)
        if m == 0:
            return out_scores, out_ids
        pending = np.arange(m)
        fetch = min(n, k + max(k, _MIN_MARGIN))
        while True:
            batch = queries if len(pending) == m else queries[_index_rows(queries, pending)]
            scores, ids = self._backend.topk(batch, fetch)
            scores, ids = _order_ties(scores, ids)
            if fetch == n:
                settled = np.ones(len(pending), dtype=bool)
            else:
                # Every profile left out scores <= the last one fetched; when the k-th score is
                # strictly above that, the fetched set holds every candidate for the top k.
                settled = scores[:, k - 1] > scores[:, fetch - 1]
            done = pending[settled]
            out_scores[done] = scores[settled, :k]
            out_ids[done] = ids[settled, :k]
            pending = pending[~settled]
            if len(pending) == 0:
                return out_scores, out_ids
            fetch = min(n, fetch * 4)

    # -- persistence ----------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the vectors, utterances, labels and fingerprint to the directory `path`.

        The vectors file is written first and the manifest (which carries the vectors'
        hash) last, each through a temporary file and an atomic rename.
        """
        if self._utterances is None:
            raise ValueError("cannot save a profile index without its utterances")
        if self._fingerprint is None:
            raise ValueError(
                "cannot save a profile index without the embedding fingerprint: a later load "
                "could not tell whether the same model made the vectors"
            )
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        vectors_tmp = folder / f".{_VECTORS}.{os.getpid()}.tmp"
        with open(vectors_tmp, "wb") as fh:
            np.save(fh, self._vectors, allow_pickle=False)
        os.replace(vectors_tmp, folder / _VECTORS)
        head_entry: dict[str, Any] | None = None
        if self._head is not None:
            head_tmp = folder / f".{_HEAD}.{os.getpid()}.tmp"
            arrays = {name: np.ascontiguousarray(a) for name, a in self._head.arrays.items()}
            with open(head_tmp, "wb") as fh:
                np.savez(fh, **arrays)  # type: ignore[arg-type]
            os.replace(head_tmp, folder / _HEAD)
            head_entry = {
                "mode": self._head.mode,
                "settings": dict(self._head.settings),
                "key": self._head.key,
                "train_seconds": self._head.train_seconds,
                "arrays_sha256": _arrays_digest(arrays),
            }
        manifest = {
            "format": _FORMAT,
            "version": _FORMAT_VERSION,
            "count": len(self),
            "dimension": self.dimension,
            "fingerprint": asdict(self._fingerprint),
            "vectors_sha256": _digest(self._vectors),
            "utterances": list(self._utterances),
            "labels": list(self._labels) if self._labels is not None else None,
            "head": head_entry,
        }
        manifest_tmp = folder / f".{_MANIFEST}.{os.getpid()}.tmp"
        manifest_tmp.write_text(json.dumps(manifest, ensure_ascii=False), encoding="utf-8")
        os.replace(manifest_tmp, folder / _MANIFEST)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        generator: EmbeddingGenerator | EmbeddingFingerprint,
        *,
        device: str | None = None,
        backend: Backend = "auto",
    ) -> ProfileIndex:
        """Read an index saved by `save`, refusing it unless `generator`'s fingerprint matches.

        Raises `IndexFormatError` for a missing, corrupt or unsupported index and
        `FingerprintMismatchError` when the saved fingerprint differs from the generator's
        (or the generator has none, so the match cannot be checked).
        """
        expected = _fingerprint_of(generator)
        folder = Path(path)
        manifest = _read_manifest(folder / _MANIFEST)
        saved = _parse_fingerprint(manifest.get("fingerprint"))
        if expected is None:
            raise FingerprintMismatchError(
                f"the embedding generator reports no fingerprint, so the index at {folder} "
                f"(built with {saved.model!r}) cannot be checked against it"
            )
        if saved != expected:
            raise FingerprintMismatchError(
                f"the index at {folder} was built with {_describe(saved)}, "
                f"but the embedding generator is {_describe(expected)}; rebuild the index"
            )
        try:
            with open(folder / _VECTORS, "rb") as fh:
                vectors = np.load(fh, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise IndexFormatError(f"cannot read the vectors of the index at {folder}: {exc}")
        count, dimension = manifest.get("count"), manifest.get("dimension")
        if vectors.dtype != np.float32 or vectors.shape != (count, dimension):
            raise IndexFormatError(
                f"the vectors at {folder} have shape {vectors.shape} and dtype {vectors.dtype}, "
                f"the manifest says ({count}, {dimension}) float32"
            )
        if _digest(vectors) != manifest.get("vectors_sha256"):
            raise IndexFormatError(f"the vectors at {folder} do not match their manifest hash")
        utterances = manifest.get("utterances")
        labels = manifest.get("labels")
        try:
            return cls(
                vectors,
                utterances=utterances,
                labels=labels,
                fingerprint=saved,
                device=device,
                backend=backend,
                head=_read_head(folder, manifest.get("head")),
                _normalized=True,
            )
        except (TypeError, ValueError) as exc:
            raise IndexFormatError(f"the index at {folder} is invalid: {exc}")

    @classmethod
    async def build(
        cls,
        generator: EmbeddingGenerator,
        entries: Sequence[tuple[str, str]],
        *,
        previous: ProfileIndex | None = None,
        device: str | None = None,
        backend: Backend = "auto",
    ) -> ProfileIndex:
        """Embed `(label, utterance)` entries into a new index, reusing `previous` vectors.

        A vector is reused for every `(label, utterance)` pair that `previous` holds, when
        `previous` was made by the same embedding model (equal, non-None fingerprints).
        The remaining distinct pairs are embedded in one `generate` call, in entry order.
        """
        if generator is None:
            raise TypeError("generator must not be None")
        pairs = _check_entries(entries)
        if not pairs:
            raise ValueError("a profile index needs at least one entry")
        fingerprint = generator.fingerprint
        known: dict[tuple[str, str], int] = {}
        dimension: int | None = None
        if (
            previous is not None
            and fingerprint is not None
            and previous.fingerprint == fingerprint
            and previous.labels is not None
            and previous.utterances is not None
        ):
            dimension = previous.dimension
            for row, pair in enumerate(zip(previous.labels, previous.utterances, strict=True)):
                known.setdefault(pair, row)
        missing = list(dict.fromkeys(pair for pair in pairs if pair not in known))
        fresh: dict[tuple[str, str], Float32Array] = {}
        if missing:
            raw = await generator.generate([utterance for _, utterance in missing])
            embedded = as_embedding_matrix(
                raw, rows=len(missing), dimension=dimension, what="profile"
            )
            normalized, _ = l2_normalize_rows(embedded)
            fresh = {pair: normalized[i] for i, pair in enumerate(missing)}
        reused = previous.vectors if previous is not None else None
        rows = [fresh[pair] if pair in fresh else _row(reused, known[pair]) for pair in pairs]
        return cls(
            np.stack(rows),
            utterances=[utterance for _, utterance in pairs],
            labels=[label for label, _ in pairs],
            fingerprint=fingerprint,
            device=device,
            backend=backend,
            _normalized=True,
        )

    @classmethod
    async def load_or_build(
        cls,
        path: str | os.PathLike[str],
        generator: EmbeddingGenerator,
        entries: Sequence[tuple[str, str]],
        *,
        device: str | None = None,
        backend: Backend = "auto",
        scoring: HeadTrainer | None = None,
    ) -> ProfileIndex:
        """The index for `entries`, reusing what is saved at `path`, and saved back there.

        A saved index made by another model, or an unreadable one, is ignored and
        everything is embedded again. Only pairs the saved index lacks are embedded. The
        result is saved when it differs from what was on disk (it needs a fingerprint).

        With a `scoring` mode that trains, the index carries its head: the saved head when
        it was trained on the same vectors, routes and settings, else a new one (the
        retraining is logged), saved with the index.
        """
        previous: ProfileIndex | None = None
        if (Path(path) / _MANIFEST).exists():
            try:
                previous = cls.load(path, generator, device="cpu", backend="faiss")
            except (FingerprintMismatchError, IndexFormatError):
                previous = None
        index = await cls.build(
            generator, entries, previous=previous, device=device, backend=backend
        )
        if scoring is not None:
            if previous is not None and previous.head is not None:
                index = index.with_head(previous.head)
            index = index.trained(scoring)
        unchanged = (
            previous is not None
            and previous.labels == index.labels
            and previous.utterances == index.utterances
            and (previous.head.key if previous.head else None)
            == (index.head.key if index.head else None)
        )
        if not unchanged and index.fingerprint is not None:
            index.save(path)
        return index


# -- helpers ------------------------------------------------------------------------------


def _check_texts(values: Sequence[str] | None, count: int, name: str) -> tuple[str, ...] | None:
    if values is None:
        return None
    if isinstance(values, str):
        raise TypeError(f"{name} must be a sequence of str, not a str")
    items = tuple(values)
    if len(items) != count:
        raise ValueError(f"{len(items)} {name} for {count} vectors")
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{name} must be str, got {type(item).__name__}")
    return items


def _check_entries(entries: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    if entries is None:
        raise TypeError("entries must not be None")
    pairs: list[tuple[str, str]] = []
    for entry in entries:
        try:
            label, utterance = entry
        except (TypeError, ValueError):
            raise TypeError("each entry must be a (label, utterance) pair")
        if not isinstance(label, str) or not isinstance(utterance, str):
            raise TypeError("labels and utterances must be str")
        if not utterance or utterance.isspace():
            raise ValueError(f"route {label!r} has an empty or whitespace-only utterance")
        pairs.append((label, utterance))
    return pairs


def _row(vectors: Float32Array | None, row: int) -> Float32Array:
    assert vectors is not None
    return np.asarray(vectors[row], dtype=np.float32)


def _index_rows(queries: Any, rows: npt.NDArray[np.intp]) -> Any:
    if type(queries).__module__.split(".")[0] == "torch":
        import torch

        return torch.as_tensor(rows, device=queries.device)
    return rows


def _order_ties(scores: Float32Array, ids: Int64Array) -> tuple[Float32Array, Int64Array]:
    """Sort each row by score descending, then by id ascending."""
    order = np.lexsort((ids, -scores), axis=1)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _digest(vectors: Float32Array) -> str:
    return hashlib.sha256(np.ascontiguousarray(vectors).tobytes()).hexdigest()


def _arrays_digest(arrays: dict[str, Float32Array]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode("utf-8"))
        digest.update(str(arrays[name].shape).encode("ascii"))
        digest.update(np.ascontiguousarray(arrays[name], dtype=np.float32).tobytes())
    return digest.hexdigest()


def _read_head(folder: Path, entry: Any) -> TrainedHead | None:
    """The saved head, or None (logged) when it is missing or damaged: it is retrained then."""
    if entry is None:
        return None
    try:
        if not isinstance(entry, dict):
            raise ValueError("the head entry is not an object")
        with np.load(folder / _HEAD, allow_pickle=False) as archive:
            arrays = {name: np.asarray(archive[name], dtype=np.float32) for name in archive.files}
        if _arrays_digest(arrays) != entry.get("arrays_sha256"):
            raise ValueError("the head arrays do not match their manifest hash")
        for array in arrays.values():
            if not np.isfinite(array).all():
                raise ValueError("the head arrays hold NaN or infinite values")
        settings, key = entry.get("settings"), entry.get("key")
        mode, seconds = entry.get("mode"), entry.get("train_seconds")
        if not isinstance(settings, dict) or not isinstance(key, str) or not isinstance(mode, str):
            raise ValueError("the head entry has fields of the wrong type")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError("the head entry has no training time")
        return TrainedHead(mode, settings, key, arrays, float(seconds))
    except (OSError, ValueError, KeyError) as exc:
        logger.warning(
            "ignoring the saved scoring head at %s (%s); it will be retrained", folder, exc
        )
        return None


def _fingerprint_of(
    source: EmbeddingGenerator | EmbeddingFingerprint | None,
) -> EmbeddingFingerprint | None:
    if source is None:
        raise TypeError("generator must not be None")
    if isinstance(source, EmbeddingFingerprint):
        return source
    fingerprint = getattr(source, "fingerprint", None)
    if fingerprint is not None and not isinstance(fingerprint, EmbeddingFingerprint):
        raise TypeError("the generator's fingerprint must be an EmbeddingFingerprint or None")
    return fingerprint


def _describe(fingerprint: EmbeddingFingerprint) -> str:
    norm = "normalised" if fingerprint.normalized else "unnormalised"
    return (
        f"{fingerprint.model!r} (weights {fingerprint.weights_sha256[:12]}, "
        f"dimension {fingerprint.dimension}, {norm})"
    )


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise IndexFormatError(f"no saved profile index at {path.parent}")
    except (OSError, ValueError) as exc:
        raise IndexFormatError(f"cannot read the profile index manifest {path}: {exc}")
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise IndexFormatError(f"{path} is not a chatroute profile index manifest")
    if manifest.get("version") != _FORMAT_VERSION:
        raise IndexFormatError(
            f"{path} has format version {manifest.get('version')!r}; "
            f"this chatroute reads version {_FORMAT_VERSION}"
        )
    return manifest


def _parse_fingerprint(raw: Any) -> EmbeddingFingerprint:
    try:
        fingerprint = EmbeddingFingerprint(**raw)
    except TypeError as exc:
        raise IndexFormatError(f"the saved fingerprint is malformed: {exc}")
    if (
        not isinstance(fingerprint.model, str)
        or not isinstance(fingerprint.weights_sha256, str)
        or isinstance(fingerprint.dimension, bool)
        or not isinstance(fingerprint.dimension, int)
        or not isinstance(fingerprint.normalized, bool)
    ):
        raise IndexFormatError(f"the saved fingerprint has fields of the wrong type: {raw!r}")
    return fingerprint


def _resolve_device(device: str | None) -> str:
    if device is None:
        return "cpu"
    text = str(device)
    if text == "cuda":
        return "cuda:0"
    return text


def _make_backend(matrix: Float32Array, device: str, backend: Backend) -> SearchBackend:
    on_cuda = device.startswith("cuda")
    if backend == "auto":
        if not on_cuda:
            return FaissCpuBackend(matrix)
        if faiss_has_gpu():
            return FaissGpuBackend(matrix, _cuda_index(device))
        return TorchBackend(matrix, device)
    if backend == "faiss":
        if on_cuda:
            raise ValueError("backend 'faiss' searches on the CPU; use 'faiss-gpu' or 'torch'")
        return FaissCpuBackend(matrix)
    if backend == "faiss-gpu":
        if not on_cuda:
            raise ValueError("backend 'faiss-gpu' needs a CUDA device")
        if not faiss_has_gpu():
            raise RuntimeError("the installed faiss has no GPU support (or sees no GPU)")
        return FaissGpuBackend(matrix, _cuda_index(device))
    if backend == "torch":
        return TorchBackend(matrix, device)
    raise ValueError(f"unknown backend {backend!r}; use 'auto', 'faiss', 'faiss-gpu' or 'torch'")


def _cuda_index(device: str) -> int:
    _, _, number = device.partition(":")
    return int(number) if number else 0
