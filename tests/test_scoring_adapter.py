"""The adapter scoring mode: training, persistence, decisions and bad input."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from chatroute import ProfileIndex, SemanticRoutingChatClient, calibrate, make_scoring
from chatroute.chat import EmbeddingFingerprint
from chatroute.config import ConfigError, parse_config
from chatroute.router.scoring import SCORING_MODES, AdapterScoring
from tests.semantic_doubles import FakeEmbeddingGenerator, NamedClient, user

FINGERPRINT = EmbeddingFingerprint(
    model="fake-model", weights_sha256="0" * 64, dimension=8, normalized=False
)
CLASSES, PER_CLASS = 3, 12


def noisy_bank(seed: int = 1) -> dict[str, list[float]]:
    """Three routes told apart by a small signal on dims 0-2, under loud shared noise on
    dims 3-7: a linear map that turns the noise down separates them."""
    rng = np.random.default_rng(seed)
    table: dict[str, list[float]] = {}
    for name, count in (("u", PER_CLASS), ("q", 40)):
        for route in range(CLASSES):
            for i in range(count):
                vector = np.zeros(8)
                vector[route] = 0.6
                vector[3:] = rng.standard_normal(5)
                table[f"{name}{route}_{i}"] = vector.tolist()
    table["zero_far"] = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0]
    return table


def bank_router(scoring: object, **kwargs: object) -> SemanticRoutingChatClient:
    gen = kwargs.pop("gen", None) or FakeEmbeddingGenerator(noisy_bank(), fingerprint=FINGERPRINT)
    profiles = kwargs.pop("profiles", None) or {
        NamedClient(f"r{route}"): [f"u{route}_{i}" for i in range(PER_CLASS)]
        for route in range(CLASSES)
    }
    return SemanticRoutingChatClient(
        gen,  # type: ignore[arg-type]
        profiles,  # type: ignore[arg-type]
        NamedClient("default"),
        scoring=scoring,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


async def accuracy(semantic: SemanticRoutingChatClient) -> float:
    texts = [f"q{route}_{i}" for route in range(CLASSES) for i in range(40)]
    decisions = await semantic.route_batch(texts)
    hits = [d.winner.name == f"r{t[1]}" for d, t in zip(decisions, texts, strict=True)]  # type: ignore[union-attr]
    return sum(hits) / len(hits)


def test_the_adapter_is_a_registered_mode_with_checked_settings() -> None:
    assert SCORING_MODES["adapter"] is AdapterScoring
    assert make_scoring("adapter") == AdapterScoring()
    assert AdapterScoring().oos_score == "route"
    with pytest.raises(ValueError, match="'top_k', 'knn', 'prototype', 'adapter'"):
        make_scoring("adaptor")
    with pytest.raises(ValueError, match="'route', 'nearest'"):
        AdapterScoring(oos_score="blend")
    for bad in ({"temperature": -1.0}, {"steps": -1}, {"batch_size": 1}, {"learning_rate": 0}):
        with pytest.raises((ValueError, TypeError)):
            AdapterScoring(**bad)  # type: ignore[arg-type]


async def test_training_learns_a_map_that_beats_the_plain_centroids() -> None:
    untrained = bank_router(AdapterScoring(steps=0))
    # A larger step than the default, for a map that moves far in this small space.
    trained = bank_router(AdapterScoring(steps=100, learning_rate=0.01))
    index = await trained.prepare()
    assert index.head is not None and index.head.mode == "adapter"
    adapter = index.head.arrays["adapter"]
    assert adapter.shape == (8, 8) and not np.allclose(adapter, np.eye(8))
    plain = await untrained.prepare()
    assert plain.head is not None and np.array_equal(plain.head.arrays["adapter"], np.eye(8))
    assert await accuracy(trained) > await accuracy(untrained) + 0.1
    decision = await trained.route(user("q1_0"))
    assert decision.scoring == "adapter" and decision.score == decision.scores[decision.winner]  # type: ignore[index]
    assert -1.0 <= min(decision.scores.values()) <= max(decision.scores.values()) <= 1.0
    assert len(decision.matches) == 1 and decision.matches[0].utterance.startswith("u")


async def test_the_adapter_head_is_deterministic_saved_and_reused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = await bank_router("adapter").prepare(), await bank_router("adapter").prepare()
    assert first.head is not None and second.head is not None
    for name in ("adapter", "centroids"):
        assert np.array_equal(first.head.arrays[name], second.head.arrays[name])
    gen = FakeEmbeddingGenerator(noisy_bank(), fingerprint=FINGERPRINT)
    entries = [(f"r{r}", f"u{r}_{i}") for r in range(CLASSES) for i in range(PER_CLASS)]
    built = await ProfileIndex.load_or_build(tmp_path, gen, entries, scoring=AdapterScoring())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["head"]["mode"] == "adapter" and manifest["head"]["settings"]["steps"] == 60
    loaded = ProfileIndex.load(tmp_path, gen)
    assert loaded.head is not None and built.head is not None
    assert loaded.head.key == built.head.key
    assert np.array_equal(loaded.head.arrays["adapter"], built.head.arrays["adapter"])
    semantic = bank_router("adapter", gen=gen, profile_index=loaded)
    assert (await semantic.prepare()).head is loaded.head  # used as it is
    with caplog.at_level(logging.WARNING, logger="chatroute.index"):
        other = bank_router(AdapterScoring(steps=5), gen=gen, profile_index=loaded)
        retrained = await other.prepare()
    assert "retraining" in caplog.text and retrained.head is not None
    assert retrained.head.key != loaded.head.key
    # A prototype head is never read as an adapter head (and the other way round).
    swapped = bank_router("prototype", gen=gen, profile_index=loaded)
    swapped_head = (await swapped.prepare()).head
    assert swapped_head is not None and swapped_head.mode == "prototype"


async def test_calibrate_fits_the_adapters_out_of_scope_scores() -> None:
    semantic = bank_router("adapter")
    routes = {f"r{r}": semantic.clients[r + 1] for r in range(CLASSES)}
    examples: list[tuple[str, str | None]] = [
        (f"q{r}_{i}", f"r{r}") for r in range(CLASSES) for i in range(20)
    ]
    examples += [("zero_far", None)] * 3
    result = await calibrate(semantic, examples, routes)  # type: ignore[arg-type]
    assert set(result.report.oos_score_objectives or {}) == {"route", "nearest"}
    assert result.scoring is not None and result.scoring.name == "adapter"


# -- bad input ----------------------------------------------------------------------------


async def test_a_one_utterance_route_is_its_adapted_vector() -> None:
    lone = NamedClient("lone")
    profiles = {
        NamedClient("r0"): [f"u0_{i}" for i in range(PER_CLASS)],
        lone: ["u1_0"],
        NamedClient("r2"): [f"u2_{i}" for i in range(PER_CLASS)],
    }
    semantic = bank_router("adapter", profiles=profiles)
    head = (await semantic.prepare()).head
    assert head is not None
    adapted = np.asarray(noisy_bank()["u1_0"], dtype=np.float32)
    adapted = (adapted / np.linalg.norm(adapted)) @ head.arrays["adapter"]
    assert np.allclose(head.arrays["centroids"][1], adapted / np.linalg.norm(adapted), atol=1e-5)
    decision = await semantic.route(user("u1_0"))
    assert decision.winner is lone and decision.scores[lone] == pytest.approx(1.0, abs=1e-5)


async def test_duplicates_a_single_route_and_a_far_query_give_finite_scores() -> None:
    one = NamedClient("only")
    for profiles in (
        {one: ["u0_0", "u0_0", "u0_0", "u0_1"]},  # duplicates, a single route
        {one: ["u0_0", "u0_0"], NamedClient("x"): ["u1_0", "u1_0"]},  # one utterance each
    ):
        semantic = bank_router("adapter", profiles=profiles)
        head = (await semantic.prepare()).head
        assert head is not None and np.isfinite(head.arrays["adapter"]).all()
        if len(profiles) == 1:  # nothing to separate: the map stays the identity
            assert np.array_equal(head.arrays["adapter"], np.eye(8))
        for query in ("q0_0", "q2_3", "zero_far"):
            decision = await semantic.route(user(query))
            assert decision.score is not None and math.isfinite(decision.score)
            assert all(math.isfinite(v) for v in decision.scores.values())


async def test_routes_with_identical_utterances_tie_to_the_route_listed_first() -> None:
    first, second = NamedClient("first"), NamedClient("second")
    for order in ((first, second), (second, first)):
        profiles = {
            order[0]: [f"u0_{i}" for i in range(PER_CLASS)],
            order[1]: [f"u0_{i}" for i in range(PER_CLASS)][::-1],
            NamedClient("r1"): [f"u1_{i}" for i in range(PER_CLASS)],
        }
        semantic = bank_router("adapter", profiles=profiles)
        for query in ("q0_0", "q0_5", "u0_2"):
            decision = await semantic.route(user(query))
            assert decision.winner is order[0]
            assert decision.scores[order[0]] == decision.scores[order[1]]


def test_the_service_config_takes_the_adapter_mode() -> None:
    data: dict[str, object] = {
        "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
        "routes": {"general": {"utterances": ["hello"], "targets": ["p"]}},
        "routing": {"default_route": "general", "scoring": "adapter", "oos_score": "nearest"},
    }
    routing = parse_config(data, environ={}).routing
    assert (routing.scoring, routing.oos_score) == ("adapter", "nearest")
    data["routing"] = {"default_route": "general", "scoring": "adapter", "oos_score": "blend"}
    with pytest.raises(ConfigError, match=r"routing\.oos_score"):
        parse_config(data, environ={})
