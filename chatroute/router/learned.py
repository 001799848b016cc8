"""Decisions of the learned scoring modes: from route scores to `RouteDecision`s."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from chatroute.chat.client import ChatClient
from chatroute.index import ProfileIndex
from chatroute.router.decision import RouteDecision, RouteMatch
from chatroute.router.scoring import ScoringMode, pick_winners, rank_columns

__all__ = ["LearnedDecisions"]

# Routes a learned mode reports in `RouteDecision.scores` (at least; `top_k` if larger).
REPORTED_ROUTES = 5


class LearnedDecisions:
    """A router's learned-mode decisions, with its route tables laid out per score column.

    `routes[0]` is the default client, `column_routes[c]` the route (an index into
    `routes`) of score column c and `pair_routes[i]` the route of profile row i. The winner
    is the best column (ties within `TIE_TOLERANCE` go to the lowest), its gated score is
    compared with its route's threshold, and a decision reports the winner and the best
    `shown` columns' scores.
    """

    __slots__ = (
        "column_clients",
        "column_thresholds",
        "default",
        "match_clients",
        "mode",
        "name",
        "shown",
        "utterances",
    )

    def __init__(
        self,
        mode: ScoringMode,
        routes: Sequence[ChatClient],
        column_routes: Sequence[int],
        pair_routes: Sequence[int],
        utterances: tuple[str, ...],
        threshold: float,
        route_thresholds: Mapping[int, float],
        top_k: int,
    ) -> None:
        self.mode = mode
        self.name = mode.name
        self.default = routes[0]
        self.column_clients = tuple(routes[route] for route in column_routes)
        self.column_thresholds = tuple(
            route_thresholds.get(route, threshold) for route in column_routes
        )
        self.match_clients = tuple(routes[route] for route in pair_routes)
        self.utterances = utterances
        self.shown = min(len(column_routes), max(top_k, REPORTED_ROUTES))

    def score(
        self, state: Any, index: ProfileIndex, queries: npt.NDArray[np.float32], k: int, gate: str
    ) -> tuple[Any, ...]:
        """A batch's matches, reported columns and their scores, winners, their scores and
        gated scores, as lists (one item per query row)."""
        mode = self.mode
        match_scores, match_ids = index.search(queries, k, normalized=True)
        scores = mode.route_scores(state, queries)
        top = rank_columns(scores, self.shown)
        winners = pick_winners(scores, top)
        gated = mode.gate(
            state, queries, scores, winners, match_scores[:, 0], gate, match_ids[:, 0]
        )
        best = scores[np.arange(scores.shape[0]), winners]
        return (
            match_scores.tolist(),
            match_ids.tolist(),
            top.tolist(),
            np.take_along_axis(scores, top, axis=1).tolist(),
            winners.tolist(),
            best.tolist(),
            gated.tolist(),
        )

    def decision(self, parts: tuple[Any, ...], row: int) -> RouteDecision:
        """Row `row`'s decision from a batch's `score` parts."""
        return self._decision(*[part[row] for part in parts])

    def one(
        self, state: Any, index: ProfileIndex, queries: npt.NDArray[np.float32], k: int, gate: str
    ) -> RouteDecision:
        """The decision for one L2-normalised query row (a batch's, its scores within the
        mode's `ONE_QUERY_TOLERANCE`)."""
        match_scores, match_ids = index.search(queries, k, normalized=True)
        scores, ids = match_scores.tolist()[0], match_ids.tolist()[0]
        top, values, winner, best, gated = self.mode.score_one(
            state, queries[0], scores[0], ids[0], self.shown, gate
        )
        return self._decision(scores, ids, top, values, winner, best, gated)

    def _decision(
        self,
        match_scores: list[float],
        match_ids: list[int],
        top: list[int],
        values: list[float],
        winner: int,
        best: float,
        score: float,
    ) -> RouteDecision:
        clients = self.column_clients
        client = clients[winner]
        reported = {client: best}
        for column, value in zip(top, values, strict=True):
            if column != winner:
                reported[clients[column]] = value
        match_clients, utterances = self.match_clients, self.utterances
        matches = tuple(
            RouteMatch(match_clients[raw_id], utterances[raw_id], raw_score, raw_id)
            for raw_score, raw_id in zip(match_scores, match_ids, strict=True)
        )
        threshold = self.column_thresholds[winner]
        passed = score >= threshold
        return RouteDecision(
            client=client if passed else self.default,
            score=score,
            scores=reported,
            matches=matches,
            is_default=not passed,
            winner=client,
            threshold=threshold,
            scoring=self.name,
        )
