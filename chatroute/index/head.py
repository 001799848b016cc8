"""A trained scoring head kept with the profile index: its arrays, settings and training key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = ["HeadTrainer", "TrainedHead", "head_key", "route_groups"]

Float32Array = npt.NDArray[np.float32]
Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True)
class TrainedHead:
    """What a scoring mode learned from the profile vectors.

    - `mode`: the scoring mode's registry name ("prototype", ...).
    - `settings`: the training settings (JSON-ready), part of `key`.
    - `key`: the training key: a hash of the mode, its settings, the profile vectors and
      which route each row belongs to. A head is reused only for an equal key.
    - `arrays`: the learned float32 arrays by name (for example one row per route).
    - `train_seconds`: how long the training took when the head was made.
    """

    mode: str
    settings: Mapping[str, Any]
    key: str
    arrays: Mapping[str, Float32Array] = field(default_factory=dict)
    train_seconds: float = 0.0


@runtime_checkable
class HeadTrainer(Protocol):
    """A scoring mode that learns a head from the profile vectors (see `TrainedHead`)."""

    @property
    def name(self) -> str:
        """The registry name of the mode."""
        ...

    @property
    def trains(self) -> bool:
        """Whether the mode learns a head at all (False: `train` is never called)."""
        ...

    def training_settings(self) -> dict[str, Any]:
        """The settings that change what `train` learns (JSON-ready)."""
        ...

    def train(self, vectors: Float32Array, groups: Int64Array, key: str) -> TrainedHead:
        """Learn a head from L2-normalised `vectors`; `groups[i]` is row i's route column."""
        ...


def route_groups(labels: tuple[str, ...] | list[str]) -> Int64Array:
    """Each row's route column: routes numbered in order of first appearance."""
    seen: dict[str, int] = {}
    return np.asarray([seen.setdefault(label, len(seen)) for label in labels], dtype=np.int64)


def head_key(trainer: HeadTrainer, vectors: Float32Array, groups: Int64Array) -> str:
    """The training key of `trainer` on these vectors and route groups."""
    digest = hashlib.sha256()
    header = {"mode": trainer.name, "settings": trainer.training_settings()}
    digest.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    digest.update(np.ascontiguousarray(groups, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(vectors, dtype=np.float32).tobytes())
    return digest.hexdigest()
