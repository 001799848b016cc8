"""Dense route scores: every route's score for each query, not only the top-K's routes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from chatroute.router.decision import ScoreAggregation

__all__ = ["RouteGather", "dense_route_scores"]


class RouteGather:
    """Which profile rows belong to which route, laid out for one vectorised gather.

    `rows[r]` lists route r's profile rows, padded with the sentinel column `size` (which
    scores -inf), so a (queries, profiles) similarity matrix becomes (queries, routes,
    longest route) with one fancy index.
    """

    __slots__ = ("counts", "routes", "rows", "size")

    def __init__(self, pair_routes: Sequence[int], routes: int) -> None:
        members: list[list[int]] = [[] for _ in range(routes)]
        for row, route in enumerate(pair_routes):
            members[route].append(row)
        width = max(1, max(len(m) for m in members))
        size = len(pair_routes)
        table = np.full((routes, width), size, dtype=np.intp)
        for route, rows in enumerate(members):
            table[route, : len(rows)] = rows
        self.size = size
        self.routes = routes
        self.rows = table
        self.counts = np.array([len(m) for m in members], dtype=np.intp)


def dense_route_scores(
    similarities: npt.NDArray[np.float32],
    gather: RouteGather,
    top_k: int,
    aggregation: ScoreAggregation,
) -> npt.NDArray[np.float32]:
    """(queries, routes) scores: each route's own best `top_k` similarities, aggregated.

    MEAN averages a route's best min(top_k, its utterances) similarities, SUM adds them and
    MAX takes the best; a route without utterances scores -inf. With `top_k` 1 (or MAX) a
    route's score is its best similarity, as in the top-K decision's winner.
    """
    queries = similarities.shape[0]
    padded = np.full((queries, gather.size + 1), -np.inf, dtype=np.float32)
    padded[:, : gather.size] = similarities
    grouped = padded[:, gather.rows]  # (queries, routes, width)
    k = min(top_k, grouped.shape[2])
    if aggregation is ScoreAggregation.MAX or k == 1:
        best_one: npt.NDArray[np.float32] = grouped.max(axis=2)
        return best_one
    best = -np.partition(-grouped, k - 1, axis=2)[:, :, :k]
    taken = np.minimum(gather.counts, k)
    finite = np.where(np.isfinite(best), best, 0.0).sum(axis=2, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = finite if aggregation is ScoreAggregation.SUM else finite / taken
    return np.where(taken > 0, out, -np.inf).astype(np.float32)
