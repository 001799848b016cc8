"""The learned modes' one-query path: the same rankings, winners and decisions as a batch.

`knn` and `adapter` decide a query alone bit for bit as in a batch; `prototype` takes a
float32 product with its prototypes alone (half the bytes of the batch's float64 one): the
same routes, winners, defaults and matches, scores within `ONE_QUERY_TOLERANCE`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from chatroute import SCORING_MODES, RouteDecision, SemanticRoutingChatClient, make_scoring
from chatroute.router.scoring import (
    ONE_QUERY_TOLERANCE,
    TIE_TOLERANCE,
    pick_winners,
    rank_columns,
    rank_one,
)
from tests.semantic_doubles import FakeEmbeddingGenerator, NamedClient

LEARNED = [name for name in SCORING_MODES if name != "top_k"]
GATES = [(mode, gate) for mode in LEARNED for gate in SCORING_MODES[mode].oos_scores]


def assert_decides_as_the_batch(
    mode: str, alone: list[RouteDecision], batched: list[RouteDecision]
) -> None:
    """Bit for bit (knn, adapter), or the same routes and scores within the tolerance."""
    if mode != "prototype":
        assert alone == batched
        assert [list(d.scores) for d in alone] == [list(d.scores) for d in batched]  # order
        return
    for one, batch in zip(alone, batched, strict=True):
        assert (one.client, one.winner, one.is_default) == (
            batch.client,
            batch.winner,
            batch.is_default,
        )
        assert (one.threshold, one.scoring, one.matches) == (
            batch.threshold,
            batch.scoring,
            batch.matches,
        )
        assert one.score is not None and batch.score is not None
        assert abs(one.score - batch.score) <= ONE_QUERY_TOLERANCE
        assert next(iter(one.scores)) is one.winner
        for client in one.scores.keys() & batch.scores.keys():
            assert abs(one.scores[client] - batch.scores[client]) <= ONE_QUERY_TOLERANCE
        # The reported routes differ only by a near tie with the last one reported.
        for some, other in ((one, batch), (batch, one)):
            last = min(other.scores.values())
            for client in some.scores.keys() - other.scores.keys():
                assert abs(some.scores[client] - last) <= 2 * ONE_QUERY_TOLERANCE


def batch_ranking(row: np.ndarray, shown: int) -> tuple[list[int], list[float], int]:
    """What the batch path makes of a one-row batch: its ranking, scores and winner."""
    top = rank_columns(row[None, :], shown)
    winner = int(pick_winners(row[None, :], top)[0])
    return top[0].tolist(), row[top[0]].tolist(), winner


def awkward_row(rng: np.random.Generator, columns: int, case: int) -> np.ndarray:
    """Scores with exact ties, near ties, signed zeros or -inf entries."""
    row = rng.uniform(-1, 1, columns).astype(np.float32)
    picks = rng.integers(columns, size=4)
    best = int(np.argmax(row))
    if case == 1:  # exact ties with the best and among the runners-up
        row[picks[:2]] = row[best]
        row[picks[2:]] = row[picks[2]]
    elif case == 2:  # near ties, inside and outside the tolerance
        row[picks[0]] = row[best] - np.float32(TIE_TOLERANCE / 4)
        row[picks[1]] = row[best] - np.float32(TIE_TOLERANCE * 4)
    elif case == 3:  # signed zeros on top
        row[:] = np.minimum(row, 0.0)
        row[picks[:2]] = [0.0, -0.0]
    elif case == 4:  # routes without a score, possibly more of them than the ranking shows
        row[rng.random(columns) < 0.8] = -np.inf
    elif case == 5:  # every column tied
        row[:] = np.float32(0.25)
    return row


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("columns", [1, 2, 3, 9, 150, 300])
def test_the_one_row_ranking_is_the_sort_and_the_tie_rule(seed: int, columns: int) -> None:
    rng = np.random.default_rng(seed * 1000 + columns)
    for case in range(6):
        row = awkward_row(rng, columns, case)
        before = row.copy()  # the ranking leaves its input as it was
        # A float64 row (as the modes compute it) is ranked by its float32 rounding.
        wide = row.astype(np.float64) + rng.uniform(-1e-9, 1e-9, columns)
        rounded = wide.astype(np.float32)
        for shown in sorted(s for s in {1, 2, 5, 8, 10, columns} if s <= columns):
            top, values, winner = batch_ranking(row, shown)
            assert rank_one(row, shown) == (top, values, winner, float(row[winner])), case
            top, values, winner = batch_ranking(rounded, shown)
            assert rank_one(wide, shown) == (top, values, winner, float(rounded[winner])), case
        assert np.array_equal(row, before) and np.array_equal(wide.astype(np.float32), rounded)


def test_a_nan_score_ranks_as_the_sort_ranks_it() -> None:
    row = np.asarray([0.1, np.nan, 0.7, 0.7, -0.2], dtype=np.float32)
    top, _, winner = batch_ranking(row, 3)
    got = rank_one(row, 3)
    assert (got[0], got[2]) == (top, winner)


def bank(seed: int = 11) -> tuple[FakeEmbeddingGenerator, dict[NamedClient, list[str]], list[str]]:
    """Clustered profiles, a twin of r0 (an exact tie) and queries, some on a profile."""
    rng = np.random.default_rng(seed)
    routes, per_route, dimension = 14, 3, 64
    centres = rng.standard_normal((routes, dimension))
    table: dict[str, list[float]] = {}
    profiles: dict[NamedClient, list[str]] = {}
    for route in range(routes):
        texts = [f"r{route}u{i}" for i in range(per_route)]
        for text in texts:
            table[text] = (centres[route] + 0.7 * rng.standard_normal(dimension)).tolist()
        profiles[NamedClient(f"r{route}")] = texts
    profiles[NamedClient("twin")] = ["r0u2", "r0u0", "r0u1"]
    queries = []
    for i in range(40):
        vector = centres[i % routes] * rng.uniform(0, 1.5) + rng.standard_normal(dimension)
        table[f"q{i}"] = vector.tolist()
        queries.append(f"q{i}")
    queries += ["r0u0", "r3u1", "r7u2"]
    return FakeEmbeddingGenerator(table), profiles, queries


@pytest.mark.parametrize(("mode", "gate"), GATES)
@pytest.mark.parametrize("top_k", [1, 3, 12])
async def test_one_query_decides_as_it_does_in_a_batch(mode: str, gate: str, top_k: int) -> None:
    gen, profiles, queries = bank()
    thresholds = {client: 0.1 * (position % 5) for position, client in enumerate(profiles)}
    router = SemanticRoutingChatClient(
        gen,
        profiles,
        NamedClient("default"),
        scoring=make_scoring(mode, oos_score=gate),
        score_threshold=0.35,
        route_thresholds=thresholds,
        top_k=top_k,
    )
    vectors = await gen.generate(queries)
    # Batches under the index's batched-search size, so the matches' float32 sums are the
    # same as a single query's and every field must be equal, bit for bit.
    batched = []
    for start in range(0, len(vectors), 8):
        batched += await router.route_embeddings(vectors[start : start + 8])
    alone = [(await router.route_embeddings(vectors[i : i + 1]))[0] for i in range(len(vectors))]
    assert_decides_as_the_batch(mode, alone, batched)
    assert any(d.is_default for d in alone) and not all(d.is_default for d in alone)
    twin = next(client for client in profiles if client.name == "twin")
    assert all(d.winner is not twin for d in alone)  # the exact tie goes to r0


Scale = tuple[dict[NamedClient, list[str]], FakeEmbeddingGenerator, np.ndarray, Any]


@pytest.fixture(scope="module")
def clinc150_scale() -> Scale:
    """150 routes x 20 utterances of dimension 384, 600 queries (some on a profile, some
    between routes), and a prototype head trained on them once for the module's gates."""
    rng = np.random.default_rng(150)
    routes, per_route, dimension = 150, 20, 384
    centres = rng.standard_normal((routes, dimension))
    rows = np.repeat(centres, per_route, axis=0) + 1.2 * rng.standard_normal(
        (routes * per_route, dimension)
    )
    table = {f"r{i // per_route}u{i % per_route}": row.tolist() for i, row in enumerate(rows)}
    profiles = {
        NamedClient(f"r{r}"): [f"r{r}u{i}" for i in range(per_route)] for r in range(routes)
    }
    count = 600
    picks = rng.integers(routes, size=(count, 2))
    mix = rng.uniform(0.0, 1.0, (count, 1))
    queries = mix * centres[picks[:, 0]] + (1 - mix) * centres[picks[:, 1]]
    queries += rng.uniform(0.5, 2.5, (count, 1)) * rng.standard_normal((count, dimension))
    queries[::20] = rows[:: per_route * 5][: len(queries[::20])]
    gen = FakeEmbeddingGenerator(table)
    trained = SemanticRoutingChatClient(gen, profiles, NamedClient("default"), scoring="prototype")
    asyncio.run(trained.prepare())
    return profiles, gen, queries.astype(np.float32), trained.profile_index


@pytest.mark.parametrize("gate", SCORING_MODES["prototype"].oos_scores)
async def test_one_query_decides_as_a_batch_at_the_scale_of_clinc150(
    gate: str,
    clinc150_scale: Scale,
) -> None:
    # Per-route thresholds around the scores: a query alone gets the batch's route, winner
    # and default, with scores within the tolerance.
    profiles, gen, vectors, index = clinc150_scale
    rng = np.random.default_rng(151)
    thresholds = {client: float(rng.uniform(0.2, 0.5)) for client in profiles}
    router = SemanticRoutingChatClient(
        gen,
        profiles,
        NamedClient("default"),
        scoring=make_scoring("prototype", oos_score=gate),
        route_thresholds=thresholds,
        profile_index=index,
    )
    batched = []  # batches of 8: the index's own float32 search is a single query's
    for start in range(0, len(vectors), 8):
        batched += await router.route_embeddings(vectors[start : start + 8])
    alone = [(await router.route_embeddings(vectors[i : i + 1]))[0] for i in range(len(vectors))]
    assert_decides_as_the_batch("prototype", alone, batched)
    defaults = sum(d.is_default for d in alone)
    assert 0.1 * len(alone) < defaults < 0.9 * len(alone)
    assert len({d.winner for d in alone}) > 100  # of the 150 routes
