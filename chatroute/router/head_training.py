"""Training of the learned scoring heads: route centroids, the prototype cosine classifier
and the adapter's linear map, each deterministic for its seed; and the settings' checks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

Float32Array = npt.NDArray[np.float32]
Int64Array = npt.NDArray[np.int64]


def centroids(vectors: Float32Array, groups: Int64Array, routes: int) -> Float32Array:
    order = np.argsort(groups, kind="stable")
    starts = np.searchsorted(groups[order], np.arange(routes))
    sums = np.add.reduceat(vectors[order].astype(np.float64), starts, axis=0)
    norms = np.linalg.norm(sums, axis=1)
    first = order[starts]
    # Utterances that cancel out (v and -v) leave no direction: fall back to the first one.
    empty = norms < 1e-6
    sums[empty] = vectors[first[empty]]
    norms[empty] = np.linalg.norm(sums[empty], axis=1)
    unit: Float32Array = (sums / norms[:, None]).astype(np.float32)
    return unit


def train_cosine_classifier(
    vectors: Float32Array,
    groups: Int64Array,
    init: Float32Array,
    *,
    temperature: float,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> Float32Array:
    routes = init.shape[0]
    weights = init.astype(np.float32, copy=True)
    if routes < 2 or steps == 0:
        return weights
    frozen = np.bincount(groups, minlength=routes) < 2  # a lone utterance is its prototype
    adam = _Adam(weights, learning_rate)
    scale = np.float32(1.0 / temperature)
    for step, batch, labels in _minibatches(vectors, groups, steps, batch_size, seed):
        norms = np.linalg.norm(weights, axis=1, keepdims=True)
        unit = weights / norms
        logits = (batch @ unit.T) * scale
        logits -= logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        probabilities[np.arange(len(labels)), labels] -= 1.0
        probabilities *= scale / len(labels)
        grad_unit = (batch.T @ probabilities).T
        grad = (grad_unit - unit * np.einsum("ij,ij->i", grad_unit, unit)[:, None]) / norms
        grad[frozen] = 0.0
        adam.step(grad, step)
    norms = np.linalg.norm(weights, axis=1, keepdims=True)
    out = (weights / np.where(norms > 0.0, norms, 1.0)).astype(np.float32)
    bad = ~np.isfinite(out).all(axis=1) | (norms[:, 0] <= 0.0)
    out[bad] = init[bad]  # never a NaN prototype: such a route keeps its centroid
    out[frozen] = init[frozen]
    return out


def unit_rows(rows: Float32Array) -> Float32Array:
    """`rows` scaled to unit length (a zero row stays zero)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    unit: Float32Array = (rows / np.where(norms > 0.0, norms, 1.0)).astype(np.float32)
    return unit


def train_adapter(
    vectors: Float32Array,
    groups: Int64Array,
    *,
    temperature: float,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> Float32Array:
    """A (d, d) map trained with a supervised contrastive loss, from the identity."""
    dimension = vectors.shape[1]
    weights = np.eye(dimension, dtype=np.float32)
    if steps == 0:
        return weights
    adam = _Adam(weights, learning_rate)
    scale = np.float32(1.0 / temperature)
    for step, batch, labels in _minibatches(vectors, groups, steps, batch_size, seed):
        adapted = batch @ weights
        norms = np.linalg.norm(adapted, axis=1, keepdims=True)
        norms = np.maximum(norms, np.float32(1e-12))
        unit = adapted / norms
        logits = (unit @ unit.T) * scale
        np.fill_diagonal(logits, -np.inf)  # an anchor is not its own candidate
        logits -= logits.max(axis=1, keepdims=True)
        probabilities = np.exp(logits)
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        positive = labels[:, None] == labels[None, :]
        np.fill_diagonal(positive, False)
        counts = positive.sum(axis=1)
        anchors = int((counts > 0).sum())  # a lone utterance in the batch has no positive
        if anchors == 0:
            continue
        # d(loss)/d(logits) per anchor: softmax minus the positives' uniform target.
        grad_logits = probabilities - positive / np.maximum(counts, 1)[:, None]
        grad_logits[counts == 0] = 0.0
        grad_logits *= scale / anchors
        grad_unit = (grad_logits + grad_logits.T) @ unit
        grad_adapted = (grad_unit - unit * np.einsum("ij,ij->i", grad_unit, unit)[:, None]) / norms
        grad = batch.T @ grad_adapted
        adam.step(grad, step)
    if not np.isfinite(weights).all():  # never a NaN score: fall back to the identity
        return np.eye(dimension, dtype=np.float32)
    return weights


def tie_identical_routes(
    prototypes: Float32Array, vectors: Float32Array, groups: Int64Array, routes: int
) -> None:
    """Routes whose profile vectors are the same multiset get the first one's prototype."""
    seen: dict[bytes, int] = {}
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], np.arange(routes + 1))
    for route in range(routes):
        rows = vectors[order[bounds[route] : bounds[route + 1]]]
        signature = np.ascontiguousarray(rows[np.lexsort(rows.T[::-1])]).tobytes()
        first = seen.setdefault(signature, route)
        if first != route:
            prototypes[route] = prototypes[first]


def positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not np.isfinite(number) or number <= 0.0:
        raise ValueError(f"{name} must be a finite number above 0, got {value}")
    return number


def count(value: Any, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _minibatches(
    vectors: Float32Array, groups: Int64Array, steps: int, batch_size: int, seed: int
) -> Iterator[tuple[int, Float32Array, Int64Array]]:
    """(step from 1, rows, labels) for `steps` steps: all rows, or `batch_size` rows drawn
    for each step."""
    rng = np.random.default_rng(seed)
    rows = vectors.shape[0]
    for step in range(1, steps + 1):
        if rows > batch_size:
            pick = np.sort(rng.choice(rows, batch_size, replace=False))
            yield step, vectors[pick], groups[pick]
        else:
            yield step, vectors, groups


class _Adam:
    """Adam (beta 0.9 / 0.999) updating `weights` in place; `step` (from 1) sets the bias
    correction, so a skipped step still counts."""

    def __init__(self, weights: Float32Array, learning_rate: float) -> None:
        self.weights = weights
        self.learning_rate = learning_rate
        self.first_moment: npt.NDArray[Any] = np.zeros_like(weights)
        self.second_moment: npt.NDArray[Any] = np.zeros_like(weights)

    def step(self, grad: npt.NDArray[Any], step: int) -> None:
        beta1, beta2 = 0.9, 0.999
        self.first_moment = beta1 * self.first_moment + (1.0 - beta1) * grad
        self.second_moment = beta2 * self.second_moment + (1.0 - beta2) * grad * grad
        corrected = self.first_moment / (1.0 - beta1**step)
        spread = np.sqrt(self.second_moment / (1.0 - beta2**step)) + 1e-8
        self.weights -= (self.learning_rate * corrected / spread).astype(np.float32)
