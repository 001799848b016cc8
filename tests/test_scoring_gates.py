"""Out-of-scope scores of the prototype mode, batch-independent decisions and tie handling."""

from __future__ import annotations

import numpy as np
import pytest

from chatroute import PrototypeScoring, SemanticRoutingChatClient, calibrate
from chatroute.config import ConfigError, parse_config
from chatroute.router.scoring import TIE_TOLERANCE, pick_winners
from tests.semantic_doubles import FakeEmbeddingGenerator, NamedClient

ROUTES, PER_ROUTE, DIMENSION = 12, 4, 384
# Enough queries that the index's search takes its batched path (a different float32 sum).
QUERIES = 1100


def bank(seed: int = 5) -> tuple[FakeEmbeddingGenerator, dict[NamedClient, list[str]]]:
    """Clustered random profiles, a twin route with r0's utterances, and query vectors."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((ROUTES, DIMENSION))
    table: dict[str, list[float]] = {}
    profiles: dict[NamedClient, list[str]] = {}
    for route in range(ROUTES):
        texts = [f"r{route}u{i}" for i in range(PER_ROUTE)]
        for text in texts:
            table[text] = (centres[route] + 0.6 * rng.standard_normal(DIMENSION)).tolist()
        profiles[NamedClient(f"r{route}")] = texts
    profiles[NamedClient("twin")] = [f"r0u{i}" for i in range(PER_ROUTE)][::-1]
    for i in range(QUERIES):
        vector = centres[i % ROUTES] * rng.uniform(0.0, 1.5) + rng.standard_normal(DIMENSION)
        table[f"q{i}"] = vector.tolist()
    for route in range(3):  # queries that sit on a profile utterance
        table[f"on{route}"] = table[f"r{route}u0"]
    return FakeEmbeddingGenerator(table), profiles


def query_texts() -> list[str]:
    return [f"q{i}" for i in range(QUERIES)] + [f"on{r}" for r in range(3)] + ["r0u1"]


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


@pytest.mark.parametrize("oos_score", PrototypeScoring.oos_scores)
async def test_a_decision_does_not_depend_on_the_batch_it_came_in(oos_score: str) -> None:
    gen, profiles = bank()
    semantic = SemanticRoutingChatClient(
        gen,
        profiles,
        NamedClient("default"),
        scoring=PrototypeScoring(oos_score=oos_score),
        score_threshold=0.4,
        top_k=3,
    )
    texts = query_texts()
    batch = await semantic.route_batch(texts)
    vectors = await gen.generate(texts)
    together = await semantic.route_embeddings(vectors)
    halves = [
        *await semantic.route_embeddings(vectors[:500]),
        *await semantic.route_embeddings(vectors[500:]),
    ]
    for position in [*range(0, QUERIES, 13), *range(QUERIES, len(texts))]:
        # Batches of any size: the same decision, bit for bit.
        for other in (together[position], halves[position]):
            assert other.winner is batch[position].winner
            assert other.client is batch[position].client
            assert other.score == batch[position].score  # bit for bit, not approximately
            assert list(other.scores.items()) == list(batch[position].scores.items())
        # A query alone takes the float32 one-query path: the same routes, scores within
        # 1e-6. (Duplicate utterances may swap places in `matches`: the index's float32
        # search orders equal vectors by their last bit, which the batch can change.)
        alone, other = (await semantic.route_batch([texts[position]]))[0], batch[position]
        assert alone.winner is other.winner and alone.client is other.client
        assert alone.score == pytest.approx(other.score, abs=1e-6)
        assert alone.scores.keys() == other.scores.keys()
        for client, value in alone.scores.items():
            assert value == pytest.approx(other.scores[client], abs=1e-6)
        assert [m.utterance for m in alone.matches] == [m.utterance for m in other.matches]


async def test_the_blend_score_is_the_mean_of_the_winners_three_cosines() -> None:
    gen, profiles = bank()
    default = NamedClient("default")
    by_name = {
        name: SemanticRoutingChatClient(
            gen, profiles, default, scoring=PrototypeScoring(oos_score=name), top_k=2
        )
        for name in PrototypeScoring.oos_scores
    }
    index = await by_name["prototype"].prepare()
    head = index.head
    assert head is not None
    centroids = head.arrays["centroids"].astype(np.float64)
    vectors = index.vectors.astype(np.float64)
    columns = {client: column for column, client in enumerate(profiles)}
    for text in query_texts()[::25]:
        query = unit(np.asarray(gen.table[text], dtype=np.float64))
        decisions = {
            name: (await router.route_batch([text]))[0] for name, router in by_name.items()
        }
        winner = decisions["prototype"].winner
        assert winner is not None and all(d.winner is winner for d in decisions.values())
        prototype = decisions["prototype"].score
        centroid = decisions["centroid"].score
        nearest = decisions["nearest"].score
        blend = decisions["blend"].score
        assert prototype is not None and centroid is not None and nearest is not None
        assert prototype == decisions["prototype"].scores[winner]
        assert centroid == pytest.approx(float(centroids[columns[winner]] @ query), abs=1e-6)
        assert nearest == pytest.approx(float((vectors @ query).max()), abs=1e-6)
        assert nearest == pytest.approx(decisions["nearest"].matches[0].score, abs=1e-5)
        assert blend == pytest.approx((prototype + centroid + nearest) / 3.0, abs=1e-6)
        assert np.isfinite(blend)


async def test_calibrate_weighs_the_blend_with_the_other_out_of_scope_scores() -> None:
    gen, profiles = bank()
    semantic = SemanticRoutingChatClient(gen, profiles, NamedClient("default"), scoring="prototype")
    routes = {client.name: client for client in profiles}
    examples: list[tuple[str, str | None]] = [(f"on{r}", f"r{r}") for r in (1, 2)]
    examples += [(f"q{i}", None) for i in range(1, 60, 2)]
    for text in [f"q{i}" for i in range(0, 60, 2)]:
        decision = (await semantic.route_batch([text]))[0]
        assert decision.winner is not None
        examples.append((text, decision.winner.name))  # type: ignore[attr-defined]
    result = await calibrate(semantic, examples, routes)
    objectives = result.report.oos_score_objectives or {}
    assert set(objectives) == {"prototype", "centroid", "nearest", "blend"}
    assert result.oos_score == max(
        objectives, key=lambda name: (objectives[name], name == "prototype")
    )
    assert result.scoring is not None and result.scoring.oos_score == result.oos_score


def test_the_twin_of_a_route_never_wins_over_it() -> None:
    # Routes with the same utterances tie exactly; the one listed first wins.
    scores = np.asarray([[0.2, 0.9, 0.5, 0.9], [0.9, 0.1, 0.9, 0.3]], dtype=np.float32)
    ranked = np.argsort(-scores, axis=1, kind="stable")
    assert pick_winners(scores, ranked).tolist() == [1, 0]
    assert pick_winners(scores[:1], ranked[:1]).tolist() == [1]


@pytest.mark.parametrize("seed", range(6))
def test_winners_from_a_ranking_follow_the_tie_rule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, columns = 40, 9
    scores = rng.uniform(-1, 1, (rows, columns)).astype(np.float32)
    # Near ties (inside and just outside the tolerance) and exact ties, anywhere in a row.
    for row in range(0, rows, 2):
        best = int(np.argmax(scores[row]))
        other = int(rng.integers(columns))
        gap = [0.0, TIE_TOLERANCE / 4, TIE_TOLERANCE * 4][row % 3]
        if other != best:
            scores[row, other] = np.float32(scores[row, best] - gap)
    plain = pick_winners(scores)
    expected = [int(np.flatnonzero(row >= row.max() - TIE_TOLERANCE)[0]) for row in scores]
    assert plain.tolist() == expected
    for shown in (2, 3, columns):
        ranked = np.argsort(-scores, axis=1, kind="stable")[:, :shown]
        assert pick_winners(scores, ranked).tolist() == expected
        for row in range(rows):  # one query at a time: the latency path
            assert pick_winners(scores[row : row + 1], ranked[row : row + 1]).tolist() == [
                expected[row]
            ]
    single = scores[:, :1]
    assert pick_winners(single, np.zeros((rows, 1), dtype=np.int64)).tolist() == [0] * rows


def test_the_service_config_takes_the_blend_for_the_prototype_mode_only() -> None:
    data: dict[str, object] = {
        "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
        "routes": {"general": {"utterances": ["hello"], "targets": ["p"]}},
        "routing": {"default_route": "general", "oos_score": "blend"},
    }
    assert parse_config(data, environ={}).routing.oos_score == "blend"
    data["routing"] = {"default_route": "general", "scoring": "knn", "oos_score": "blend"}
    with pytest.raises(ConfigError, match=r"routing\.oos_score"):
        parse_config(data, environ={})
