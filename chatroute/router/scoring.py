"""Scoring modes: how a semantic router turns a query vector into per-route scores.

A mode is one class behind `ScoringMode`, registered by name in `SCORING_MODES`:

- `TopKScoring` ("top_k"): the contract rule (global top-K profile hits, aggregated per
  route); no training.
- `KnnScoring` ("knn"): a softmax-weighted vote of every profile, per route; no training.
- `PrototypeScoring` ("prototype"): one learned unit vector per route, trained as a cosine
  classifier on the profile vectors when the index is built.
- `AdapterScoring` ("adapter"): a linear map of the embeddings trained with a supervised
  contrastive loss when the index is built, then one centroid per route in its space.

Every mode scores on a cosine-like scale in [-1, 1]. The score a winner's threshold is
compared with is the mode's "out-of-scope score" (`oos_score`), one of `oos_scores`;
`calibrate()` tries each and keeps the one that fits the labelled examples best.
"""

from __future__ import annotations

import copy
import math
from abc import ABC
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from chatroute.index import ProfileIndex, TrainedHead
from chatroute.router import head_training as training

__all__ = [
    "SCORING_MODES",
    "AdapterScoring",
    "KnnScoring",
    "PrototypeScoring",
    "ScoringMode",
    "TopKScoring",
    "make_scoring",
]

Float32Array = npt.NDArray[np.float32]
Int64Array = npt.NDArray[np.int64]
# One query's ranked columns, their scores, the winner's column, its score, its gated score.
OneScored = tuple[list[int], list[float], int, float, float]

# Route scores this close to the best count as a tie; ties go to the route listed first.
TIE_TOLERANCE = 1e-6
# How far a query's scores alone (`score_one`) may be from the same query's in a batch.
ONE_QUERY_TOLERANCE = 1e-6
# What `rank_one` writes over a column it has picked.
_PICKED = np.float32(-np.inf)


class ScoringMode(ABC):
    """One way of scoring routes.

    Subclasses set `name`, `oos_scores` and, if they learn, `trains = True` with
    `training_settings` and `train`; dense modes implement `prepare` and `route_scores`
    (one score per route column for each query row), and may override `score_one` (a
    single query's decision values, with fewer array calls than a one-row batch). Scores
    are float32 computed in float64, so that a query's scores do not depend on the batch
    it came in; a one-query path may compute in float32 (`prototype` does), within
    `ONE_QUERY_TOLERANCE` of the batch's scores.
    """

    name: ClassVar[str]
    oos_scores: ClassVar[tuple[str, ...]]
    trains: ClassVar[bool] = False
    default_threshold: ClassVar[float] = 0.3
    """The service's threshold when the config sets none: each mode's scores have their
    own spread, so the same threshold means a different strictness in each (the values
    are the contract's 0.3 moved by the gap between the modes' best thresholds on
    CLINC150 val, docs/scoring.md)."""

    def __init__(self, *, oos_score: str | None = None) -> None:
        self._oos_score = self._check_oos_score(oos_score)

    @property
    def oos_score(self) -> str:
        """The score a winner's threshold is compared with (one of `oos_scores`)."""
        return self._oos_score

    def with_oos_score(self, oos_score: str) -> ScoringMode:
        """A copy of this mode that gates on `oos_score` (training settings unchanged)."""
        other = copy.copy(self)
        other._oos_score = self._check_oos_score(oos_score)
        return other

    def settings(self) -> dict[str, Any]:
        """Every setting of the mode, for logs and answers."""
        return {**self.training_settings(), "oos_score": self._oos_score}

    def training_settings(self) -> dict[str, Any]:
        """The settings that change what `train` learns (part of the head's key)."""
        return {}

    def train(self, vectors: Float32Array, groups: Int64Array, key: str) -> TrainedHead:
        """Learn a head from L2-normalised `vectors`; `groups[i]` is row i's route column."""
        raise NotImplementedError(f"the {self.name!r} scoring mode does not train")

    def prepare(self, index: ProfileIndex, groups: Int64Array, routes: int) -> Any:
        """The state `route_scores` reads, made once per index (and head)."""
        raise NotImplementedError

    def route_scores(self, state: Any, queries: Float32Array) -> Float32Array:
        """(m, routes) cosine-like scores of L2-normalised query rows."""
        raise NotImplementedError

    def gate(
        self,
        state: Any,
        queries: Float32Array,
        scores: Float32Array,
        winners: Int64Array,
        nearest: Float32Array,
        oos_score: str,
        nearest_ids: Int64Array | None = None,
    ) -> Float32Array:
        """The out-of-scope score of each row.

        `nearest` is each row's best profile cosine as the index found it, `nearest_ids`
        (when known) that profile's row in the index.
        """
        if oos_score == "nearest":
            return nearest
        rows = 0 if winners.shape[0] == 1 else np.arange(scores.shape[0])
        gated: Float32Array = scores[rows, winners]
        return gated

    def score_one(
        self,
        state: Any,
        query: Float32Array,
        nearest: float,
        nearest_id: int,
        shown: int,
        gate: str,
    ) -> OneScored:
        """One L2-normalised query's ranking and gated score, as a one-row batch gives them.

        Returns the `shown` best columns (best first, as `rank_columns` orders them), their
        scores, the winner's column (`pick_winners`), its score and its `gate` score. Dense
        modes may override it with fewer array calls or narrower floats; the winner must
        stay the batch's, the scores within `ONE_QUERY_TOLERANCE` of the batch's.
        """
        queries = query[None, :]
        row = self.route_scores(state, queries)[0]
        top, values, winner, best = rank_one(row, shown)
        gated = self.gate(
            state,
            queries,
            row[None, :],
            np.array([winner]),
            np.array([nearest], dtype=np.float32),
            gate,
            np.array([nearest_id]),
        )
        return top, values, winner, best, float(gated[0])

    def __repr__(self) -> str:
        items = ", ".join(f"{key}={value!r}" for key, value in self.settings().items())
        return f"{type(self).__name__}({items})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.settings() == self.settings()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.settings().items()))))

    def _check_oos_score(self, oos_score: str | None) -> str:
        if oos_score is None:
            return self.oos_scores[0]
        if oos_score not in self.oos_scores:
            raise ValueError(
                f"the {self.name!r} scoring mode has no out-of-scope score {oos_score!r}; "
                f"use one of {', '.join(repr(n) for n in self.oos_scores)}"
            )
        return oos_score


class TopKScoring(ScoringMode):
    """The contract rule: the global top-`top_k` profile hits, aggregated per route.

    The router runs it itself (its `top_k` and `score_aggregation` settings); the mode
    only names it. Nothing is trained and a profile edit takes effect at once.
    """

    name = "top_k"
    oos_scores = ("aggregate",)


class KnnScoring(ScoringMode):
    """A softmax-weighted vote of every profile utterance.

    A route's score is `T * log(mean(exp(cos_i / T)))` over its utterances' cosines to
    the query: a smooth maximum that lies between their mean (large T) and their best
    (small T), so it stays on the cosine scale. `temperature` T defaults to 0.07 (the
    best of 0.01-0.2 on CLINC150's validation split). Nothing is trained: a profile edit
    takes effect at once. Every profile is scored for every query (an exact matmul), so
    it suits banks up to some tens of thousands of utterances.

    Out-of-scope scores: "route" (the winner's score) or "nearest" (the best cosine).
    """

    name = "knn"
    oos_scores = ("route", "nearest")
    default_threshold = 0.25

    def __init__(self, *, temperature: float = 0.07, oos_score: str | None = None) -> None:
        super().__init__(oos_score=oos_score)
        self.temperature = training.positive(temperature, "temperature")

    def training_settings(self) -> dict[str, Any]:
        return {"temperature": self.temperature}

    def prepare(self, index: ProfileIndex, groups: Int64Array, routes: int) -> Any:
        order = np.argsort(groups, kind="stable")
        counts = np.bincount(groups, minlength=routes)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        vectors = np.ascontiguousarray(index.vectors[order].T, dtype=np.float64)
        return vectors, starts, counts.astype(np.float64)

    def route_scores(self, state: Any, queries: Float32Array) -> Float32Array:
        vectors, starts, counts = state
        temperature = self.temperature
        cosines = queries.astype(np.float64) @ vectors
        best = np.maximum.reduceat(cosines, starts, axis=1)
        spread = np.repeat(best, counts.astype(np.int64), axis=1)
        weights = np.exp((cosines - spread) / temperature)
        # Each route's own best term is exp(0) = 1, so the sum never underflows to 0.
        sums = np.add.reduceat(weights, starts, axis=1)
        out = best + temperature * np.log(sums / counts)
        clipped: Float32Array = np.clip(out, -1.0, 1.0).astype(np.float32)
        return clipped


class _GradientTrained(ScoringMode):
    """A mode whose head is trained by seeded gradient steps on the profile vectors."""

    trains = True
    min_batch_size: ClassVar[int] = 1

    def __init__(
        self,
        *,
        temperature: float,
        steps: int,
        learning_rate: float,
        batch_size: int,
        seed: int,
        oos_score: str | None,
    ) -> None:
        super().__init__(oos_score=oos_score)
        self.temperature = training.positive(temperature, "temperature")
        self.learning_rate = training.positive(learning_rate, "learning_rate")
        self.steps = training.count(steps, "steps", minimum=0)
        self.batch_size = training.count(batch_size, "batch_size", minimum=self.min_batch_size)
        self.seed = training.count(seed, "seed", minimum=0)

    def training_settings(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "steps": self.steps,
            "learning_rate": self.learning_rate,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }


class PrototypeScoring(_GradientTrained):
    """One learned unit vector (prototype) per route, scored by cosine.

    Training (when the profile index is built): each prototype starts at the normalised
    centroid of its route's profile vectors, then `steps` Adam steps (`learning_rate`)
    minimise the cross-entropy of a cosine classifier with logits `cos / temperature` on
    the profile vectors only; banks over `batch_size` rows are sampled in seeded
    minibatches. The result is the same on every rerun (fixed seed, no other randomness).
    A route with one utterance keeps that vector as its prototype; routes with identical
    utterance sets keep identical prototypes (their tie goes to the route listed first).

    Defaults (temperature 0.05, 50 steps, learning rate 0.01) were chosen on CLINC150's
    validation split only, from a flat region (89.8-90.4% top-1 for T 0.05-0.07, 20-50
    steps, rate 0.01-0.05).

    Out-of-scope scores: "prototype" (the winner's score, the default, so that a
    decision's `score` is its winner's entry in `scores`), "centroid" (the query's cosine
    to the winner's centroid), "nearest" (the best profile cosine) or "blend" (the mean of
    those three cosines; the best fit on CLINC150's validation split).

    A batch computes its cosines in float64; a query alone (the latency path) takes a
    float32 product with the prototypes and the index's own nearest cosine, within 1e-6
    of the batch's scores (a route whose score is that close to another's may take its
    place at the end of `scores`).
    """

    name = "prototype"
    oos_scores = ("prototype", "centroid", "nearest", "blend")
    default_threshold = 0.2

    def __init__(
        self,
        *,
        temperature: float = 0.05,
        steps: int = 50,
        learning_rate: float = 0.01,
        batch_size: int = 4096,
        seed: int = 0,
        oos_score: str | None = None,
    ) -> None:
        super().__init__(
            temperature=temperature,
            steps=steps,
            learning_rate=learning_rate,
            batch_size=batch_size,
            seed=seed,
            oos_score=oos_score,
        )

    def train(self, vectors: Float32Array, groups: Int64Array, key: str) -> TrainedHead:
        routes = int(groups.max()) + 1
        centroids = training.centroids(vectors, groups, routes)
        prototypes = training.train_cosine_classifier(
            vectors,
            groups,
            centroids,
            temperature=self.temperature,
            steps=self.steps,
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            seed=self.seed,
        )
        training.tie_identical_routes(prototypes, vectors, groups, routes)
        return TrainedHead(
            self.name,
            self.training_settings(),
            key,
            {"prototypes": prototypes, "centroids": centroids},
        )

    def prepare(self, index: ProfileIndex, groups: Int64Array, routes: int) -> Any:
        head = index.head
        if head is None or head.mode != self.name:
            raise ValueError("the prototype scoring mode needs a trained head on the index")
        prototypes, centroids = head.arrays["prototypes"], head.arrays["centroids"]
        if prototypes.shape != (routes, index.dimension) or centroids.shape != prototypes.shape:
            raise ValueError(
                f"the prototype head has shape {prototypes.shape}, "
                f"the index needs ({routes}, {index.dimension})"
            )
        # The batch path's float64 tables, then the one-query path's float32 rows (the
        # head's own arrays: half the bytes a latency-bound product reads). A float32
        # product's last bit can depend on a row's position, so identical prototypes (twin
        # routes) are scored once and spread back, and twins still tie exactly.
        rows = np.ascontiguousarray(prototypes, dtype=np.float32)
        distinct, spread = np.unique(rows, axis=0, return_inverse=True)
        return (
            np.ascontiguousarray(prototypes.T, dtype=np.float64),
            np.ascontiguousarray(centroids, dtype=np.float64),
            index.vectors,
            rows if len(distinct) == routes else np.ascontiguousarray(distinct),
            np.ascontiguousarray(centroids, dtype=np.float32),
            None if len(distinct) == routes else spread.reshape(-1),
        )

    def route_scores(self, state: Any, queries: Float32Array) -> Float32Array:
        prototypes_t = state[0]
        if queries.shape[0] == 1:  # one query: a float64 matrix-vector product
            row: Float32Array = np.dot(queries[0], prototypes_t).astype(np.float32)
            return row[None, :]
        scores: Float32Array = (queries.astype(np.float64) @ prototypes_t).astype(np.float32)
        return scores

    def score_one(
        self,
        state: Any,
        query: Float32Array,
        nearest: float,
        nearest_id: int,
        shown: int,
        gate: str,
    ) -> OneScored:
        # float32 products of the head's float32 rows: within 1e-6 of the batch's float64
        # scores (docs/scoring.md), and the nearest cosine is the index's own.
        prototypes, centroids, spread = state[3:]
        row = np.dot(prototypes, query)
        top, values, winner, best = rank_one(row if spread is None else row[spread], shown)
        if gate == "prototype":
            return top, values, winner, best, best
        if gate == "nearest":
            return top, values, winner, best, nearest
        value = float(np.dot(centroids[winner], query))
        if gate == "blend":  # the mean of the three cosines, summed in float64
            value += best
            value += nearest
            value /= 3.0
        return top, values, winner, best, float(np.float32(value))

    def gate(
        self,
        state: Any,
        queries: Float32Array,
        scores: Float32Array,
        winners: Int64Array,
        nearest: Float32Array,
        oos_score: str,
        nearest_ids: Int64Array | None = None,
    ) -> Float32Array:
        if oos_score == "prototype" or (oos_score == "nearest" and nearest_ids is None):
            return super().gate(state, queries, scores, winners, nearest, oos_score)
        _, centroids, vectors = state[:3]
        # Cosines to the winner's centroid and the nearest profile are recomputed here in
        # float64 (the index's own float32 scores may differ in their last bit between a
        # batch and a single query), so that a query's score does not depend on its batch.
        if winners.shape[0] == 1:  # one query: float64 products and sums, without the arrays
            column = int(winners[0])
            query = queries[0]
            if oos_score == "nearest":
                value = _cosine(vectors, nearest_ids, query, nearest)
            else:
                value = float(np.dot(centroids[column], query))
            if oos_score == "blend":
                value += float(scores[0, column])
                value += _cosine(vectors, nearest_ids, query, nearest)
                value /= 3.0
            return np.array([value], dtype=np.float32)
        wide = queries.astype(np.float64)
        if oos_score == "nearest":
            return _cosines(vectors, nearest_ids, wide, nearest).astype(np.float32)
        cosines = np.einsum("ij,ij->i", wide, centroids[winners])
        if oos_score == "blend":  # the mean of the three cosines, summed in float64
            cosines += scores[np.arange(scores.shape[0]), winners]
            cosines += _cosines(vectors, nearest_ids, wide, nearest)
            cosines /= 3.0
        result: Float32Array = cosines.astype(np.float32)
        return result


class AdapterScoring(_GradientTrained):
    """A linear adapter on the frozen embeddings, then one centroid per route in its space.

    Training (when the profile index is built): a d x d matrix W starts at the identity,
    then `steps` Adam steps (`learning_rate`) minimise a supervised contrastive loss with
    temperature `temperature` over seeded minibatches of `batch_size` profile vectors:
    each adapted, normalised vector is pulled toward the other utterances of its route and
    pushed away from the rest. A route's centroid is the normalised mean of its adapted,
    normalised utterances; a route scores the cosine between the adapted query and its
    centroid. The result is the same on every rerun (fixed seed, no other randomness).
    With a single route W stays the identity; routes with identical utterance sets get
    identical centroids (their tie goes to the route listed first).

    Defaults (temperature 0.05, 60 steps of 1,024 vectors, learning rate 0.001) were chosen
    on CLINC150's validation split only, for the balanced accuracy after `calibrate()`.

    Out-of-scope scores: "route" (the winner's score, the default) or "nearest" (the best
    profile cosine, in the embedding space).
    """

    name = "adapter"
    oos_scores = ("route", "nearest")
    min_batch_size = 2
    default_threshold = 0.58

    def __init__(
        self,
        *,
        temperature: float = 0.05,
        steps: int = 60,
        learning_rate: float = 0.001,
        batch_size: int = 1024,
        seed: int = 0,
        oos_score: str | None = None,
    ) -> None:
        super().__init__(
            temperature=temperature,
            steps=steps,
            learning_rate=learning_rate,
            batch_size=batch_size,
            seed=seed,
            oos_score=oos_score,
        )

    def train(self, vectors: Float32Array, groups: Int64Array, key: str) -> TrainedHead:
        routes = int(groups.max()) + 1
        adapter = training.train_adapter(
            vectors,
            groups,
            temperature=self.temperature,
            steps=self.steps if routes > 1 else 0,
            learning_rate=self.learning_rate,
            batch_size=self.batch_size,
            seed=self.seed,
        )
        adapted = np.empty_like(vectors)
        for start in range(0, vectors.shape[0], 8192):
            adapted[start : start + 8192] = training.unit_rows(
                vectors[start : start + 8192] @ adapter
            )
        centroids = training.centroids(adapted, groups, routes)
        training.tie_identical_routes(centroids, vectors, groups, routes)
        return TrainedHead(
            self.name, self.training_settings(), key, {"adapter": adapter, "centroids": centroids}
        )

    def prepare(self, index: ProfileIndex, groups: Int64Array, routes: int) -> Any:
        head = index.head
        if head is None or head.mode != self.name:
            raise ValueError("the adapter scoring mode needs a trained head on the index")
        adapter, centroids = head.arrays["adapter"], head.arrays["centroids"]
        dimension = index.dimension
        if adapter.shape != (dimension, dimension) or centroids.shape != (routes, dimension):
            raise ValueError(
                f"the adapter head has shapes {adapter.shape} and {centroids.shape}, "
                f"the index needs ({dimension}, {dimension}) and ({routes}, {dimension})"
            )
        return (
            np.ascontiguousarray(adapter, dtype=np.float64),
            np.ascontiguousarray(centroids.T, dtype=np.float64),
            index.vectors,
        )

    def route_scores(self, state: Any, queries: Float32Array) -> Float32Array:
        adapter, centroids_t, _ = state
        if queries.shape[0] == 1:  # one query: float64 matrix-vector products
            adapted = np.dot(queries[0], adapter)[None, :]
        else:
            adapted = queries.astype(np.float64) @ adapter
        norms = np.sqrt(np.einsum("ij,ij->i", adapted, adapted))
        adapted /= np.where(norms > 0.0, norms, 1.0)[:, None]  # a zero row scores 0
        scores: Float32Array = (adapted @ centroids_t).astype(np.float32)
        return scores

    def score_one(
        self,
        state: Any,
        query: Float32Array,
        nearest: float,
        nearest_id: int,
        shown: int,
        gate: str,
    ) -> OneScored:
        adapter, centroids_t, vectors = state
        wide = query.astype(np.float64)
        adapted = np.dot(wide, adapter)[None, :]  # `route_scores`' one-query products
        norm = float(np.sqrt(np.einsum("ij,ij->i", adapted, adapted))[0])
        adapted /= norm if norm > 0.0 else 1.0
        top, values, winner, best = rank_one((adapted @ centroids_t)[0], shown)
        if gate == "nearest":
            value = float(np.dot(vectors[nearest_id], wide))
            return top, values, winner, best, float(np.float32(value))
        return top, values, winner, best, best

    def gate(
        self,
        state: Any,
        queries: Float32Array,
        scores: Float32Array,
        winners: Int64Array,
        nearest: Float32Array,
        oos_score: str,
        nearest_ids: Int64Array | None = None,
    ) -> Float32Array:
        if oos_score == "nearest" and nearest_ids is not None:  # in float64, as the scores
            vectors = state[2]
            if winners.shape[0] == 1:
                value = _cosine(vectors, nearest_ids, queries[0], nearest)
                return np.array([value], dtype=np.float32)
            wide = queries.astype(np.float64)
            return _cosines(vectors, nearest_ids, wide, nearest).astype(np.float32)
        return super().gate(state, queries, scores, winners, nearest, oos_score)


SCORING_MODES: Mapping[str, type[ScoringMode]] = {
    TopKScoring.name: TopKScoring,
    KnnScoring.name: KnnScoring,
    PrototypeScoring.name: PrototypeScoring,
    AdapterScoring.name: AdapterScoring,
}


def make_scoring(spec: str | ScoringMode, *, oos_score: str | None = None) -> ScoringMode:
    """The scoring mode `spec` names (with its default settings), or `spec` itself.

    Raises `ValueError` listing the valid names for an unknown name, and for an
    `oos_score` the mode does not have.
    """
    if isinstance(spec, ScoringMode):
        return spec if oos_score is None else spec.with_oos_score(oos_score)
    if not isinstance(spec, str):
        raise TypeError(f"scoring must be a mode name or a ScoringMode, got {type(spec).__name__}")
    kind = SCORING_MODES.get(spec)
    if kind is None:
        valid = ", ".join(repr(name) for name in SCORING_MODES)
        raise ValueError(f"unknown scoring mode {spec!r}; valid modes: {valid}")
    return kind(oos_score=oos_score)


def rank_columns(scores: Float32Array, shown: int) -> Int64Array:
    """Each row's `shown` best columns, best first (up to 256 columns: ties to the lowest)."""
    columns = scores.shape[1]
    if scores.shape[0] == 1 and columns <= 256:  # one query: a 1-D sort is cheaper
        return np.argsort(-scores[0], kind="stable")[None, :shown]
    if columns <= 256:  # a full sort of a short row beats partitioning it
        return np.argsort(-scores, axis=1, kind="stable")[:, :shown]
    if shown < columns:
        top = np.argpartition(-scores, shown - 1, axis=1)[:, :shown]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
        return np.take_along_axis(top, order, axis=1)
    return np.argsort(-scores, axis=1, kind="stable")


def rank_one(row: npt.NDArray[Any], shown: int) -> tuple[list[int], list[float], int, float]:
    """One score row's `rank_columns` ranking, its scores, and its `pick_winners` winner.

    `row` is read as float32 (a float64 row is rounded first, as `route_scores` rounds it).
    Up to 256 columns and 8 shown, repeated argmax picks (each the first best of what is
    left, so ties go to the lowest column, as the stable sort orders them) replace the sort.
    """
    work = row.astype(np.float32)  # a copy: picked columns are overwritten below
    top: list[int] = []
    values: list[float] = []
    if work.shape[0] <= 256 and shown <= 8:
        for _ in range(shown):
            column = int(work.argmax())
            top.append(column)
            values.append(work.item(column))
            work[column] = _PICKED
    # Fewer than `shown` scores above -inf (the last pick read -inf) or a NaN (argmax
    # returns the first NaN): the sort's own order.
    if not top or values[-1] == -math.inf or math.isnan(values[0]):
        work = row.astype(np.float32)
        top = rank_columns(work[None, :], shown)[0].tolist()
        values = work[top].tolist()
    if shown >= 2 and values[1] < values[0] - TIE_TOLERANCE:
        return top, values, top[0], values[0]
    work = row.astype(np.float32)
    winner = int(pick_winners(work[None, :])[0])
    return top, values, winner, work.item(winner)


def pick_winners(scores: Float32Array, ranked: Int64Array | None = None) -> Int64Array:
    """Each row's best column; scores within `TIE_TOLERANCE` of the best go to the lowest.

    `ranked`, when given, holds at least each row's two best columns, best first (as a
    stable descending sort gives them): a row whose runner-up is not within the tolerance
    of its best is won by its best column without another pass over the row.
    """
    rows = scores.shape[0]
    if ranked is not None and ranked.shape[1] >= 2:
        if rows == 1:  # the latency path: two scalar reads instead of four array passes
            best, runner = float(scores[0, ranked[0, 0]]), float(scores[0, ranked[0, 1]])
            if runner < best - TIE_TOLERANCE:
                lead: Int64Array = ranked[:, 0]
                return lead
        else:
            lead = ranked[:, 0].copy()
            every = np.arange(rows)
            near = scores[every, ranked[:, 1]] >= scores[every, lead] - TIE_TOLERANCE
            if near.any():
                lead[near] = pick_winners(scores[near])
            return lead
    best = scores.max(axis=1, keepdims=True)
    best -= TIE_TOLERANCE
    winners: Int64Array = np.argmax(scores >= best, axis=1)
    return winners


def _cosine(
    vectors: Float32Array, ids: Int64Array | None, query: Float32Array, found: Any
) -> float:
    """One query's float64 cosine to profile row `ids[0]` (`found[0]` without ids)."""
    if ids is None:
        return float(found[0])
    return float(np.dot(vectors[int(ids[0])].astype(np.float64), query))


def _cosines(
    vectors: Float32Array, ids: Int64Array | None, queries: npt.NDArray[np.float64], found: Any
) -> npt.NDArray[np.float64]:
    """Each float64 query row's cosine to its profile row `ids[i]` (`found` without ids)."""
    if ids is None:
        return np.asarray(found, dtype=np.float64)
    cosines: npt.NDArray[np.float64] = np.einsum(
        "ij,ij->i", queries, vectors[ids].astype(np.float64)
    )
    return cosines
