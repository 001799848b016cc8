"""Scoring modes: top_k, knn and the trained prototype head, persistence, calibration, bad input."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from chatroute import (
    SCORING_MODES,
    KnnScoring,
    ProfileIndex,
    PrototypeScoring,
    SemanticRoutingChatClient,
    TopKScoring,
    calibrate,
    make_scoring,
)
from chatroute.chat import EmbeddingFingerprint
from chatroute.config import ChatrouteConfig, ConfigError, RoutingConfig, parse_config
from tests.semantic_doubles import FakeEmbeddingGenerator, NamedClient, user

FINGERPRINT3 = EmbeddingFingerprint(
    model="fake-model", weights_sha256="0" * 64, dimension=3, normalized=False
)

# Two clusters in 3-d: "code" utterances near x, "math" near y; z is out of scope.
TABLE = {
    "c1": [1.0, 0.1, 0.0],
    "c2": [0.9, 0.3, 0.1],
    "c3": [1.0, -0.2, 0.1],
    "m1": [0.1, 1.0, 0.0],
    "m2": [0.3, 0.9, -0.1],
    "m3": [-0.1, 1.0, 0.2],
    "lone": [0.0, 0.2, 1.0],
    "q_code": [0.95, 0.05, 0.05],
    "q_math": [0.05, 0.95, 0.05],
    "q_mid": [0.7, 0.62, 0.0],
    "q_far": [0.05, -0.05, -1.0],
}


def generator() -> FakeEmbeddingGenerator:
    return FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT3)


def clients() -> tuple[NamedClient, NamedClient, NamedClient]:
    return NamedClient("code"), NamedClient("math"), NamedClient("default")


def router(scoring: object = "top_k", **kwargs: object) -> SemanticRoutingChatClient:
    code, math_, default = clients()
    profiles = kwargs.pop("profiles", None) or {code: ["c1", "c2", "c3"], math_: ["m1", "m2", "m3"]}
    return SemanticRoutingChatClient(
        kwargs.pop("gen", None) or generator(),  # type: ignore[arg-type]
        profiles,  # type: ignore[arg-type]
        default,
        scoring=scoring,  # type: ignore[arg-type]
        **kwargs,  # type: ignore[arg-type]
    )


# -- names and the protocol ---------------------------------------------------------------


def test_unknown_scoring_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'top_k', 'knn', 'prototype'") as caught:
        router("centroids")
    assert "unknown scoring mode 'centroids'" in str(caught.value)
    with pytest.raises(ValueError, match="valid modes"):
        make_scoring("Prototype")
    with pytest.raises(TypeError):
        make_scoring(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'prototype', 'centroid', 'nearest'"):
        PrototypeScoring(oos_score="aggregate")
    assert set(SCORING_MODES) == {"top_k", "knn", "prototype", "adapter"}
    # The config's literal lists exactly the registered modes.
    literal = RoutingConfig.model_fields["scoring"].annotation
    assert set(literal.__args__) == set(SCORING_MODES)  # type: ignore[union-attr]


def test_modes_are_given_by_name_or_instance_and_validate_their_settings() -> None:
    assert isinstance(router().scoring, TopKScoring)  # the library default
    mode = PrototypeScoring(temperature=0.1, steps=5)
    assert router(mode).scoring is mode
    assert make_scoring("knn", oos_score="nearest") == KnnScoring(oos_score="nearest")
    for bad in ({"temperature": 0.0}, {"temperature": math.nan}, {"steps": -1}, {"seed": 1.5}):
        with pytest.raises((ValueError, TypeError)):
            PrototypeScoring(**bad)  # type: ignore[arg-type]
    # Outside top_k, scores are on the cosine scale: a sum-sized threshold is refused.
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        router("prototype", score_threshold=1.5)


async def test_top_k_stays_the_contract_rule_and_names_itself() -> None:
    plain, named = router(top_k=2), router("top_k", top_k=2)
    for query in ("q_code", "q_math", "q_mid", "q_far"):
        a, b = await plain.route(user(query)), await named.route(user(query))
        assert (a.score, a.is_default, a.client.name) == (b.score, b.is_default, b.client.name)
        assert a.scoring == "top_k"
    assert plain.training_seconds == 0.0 and plain.profile_index is not None
    assert plain.profile_index.head is None


# -- the learned modes --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["knn", "prototype"])
async def test_learned_modes_route_with_cosine_scores_scores_and_matches(mode: str) -> None:
    semantic = router(mode, top_k=2, score_threshold=0.5)
    assert semantic.training_seconds is None  # nothing built yet
    code = await semantic.route(user("q_code"))
    assert code.client.name == "code" and not code.is_default and code.scoring == mode
    assert code.score == code.scores[code.client]  # the default gate is the winner's score
    assert -1.0 <= min(code.scores.values()) <= max(code.scores.values()) <= 1.0
    assert next(iter(code.scores)) is code.client  # the winner first
    assert len(code.matches) == 2 and code.matches[0].utterance.startswith("c")
    assert (await semantic.route(user("q_math"))).client.name == "math"
    far = await semantic.route(user("q_far"))
    assert far.is_default and far.client.name == "default" and far.winner is not None
    batch = await semantic.route_batch(["q_code", "", "q_math"])
    assert [d.client.name for d in batch] == ["code", "default", "math"]
    assert batch[1].scoring == mode and batch[1].score is None
    assert semantic.training_seconds is not None and semantic.training_seconds >= 0.0


async def test_knn_score_is_a_smooth_maximum_between_mean_and_best_cosine() -> None:
    sharp, soft = router(KnnScoring(temperature=1e-3)), router(KnnScoring(temperature=100.0))
    vectors = {k: np.asarray(v) / np.linalg.norm(v) for k, v in TABLE.items()}
    cosines = [float(vectors["q_mid"] @ vectors[u]) for u in ("c1", "c2", "c3")]
    sharp_scores = (await sharp.route(user("q_mid"))).scores
    soft_scores = (await soft.route(user("q_mid"))).scores
    sharp_code = next(v for c, v in sharp_scores.items() if c.name == "code")
    soft_code = next(v for c, v in soft_scores.items() if c.name == "code")
    # At most T * log(3) below the best of the three cosines.
    assert max(cosines) - 1e-3 * math.log(3) - 1e-6 <= sharp_code <= max(cosines)
    assert soft_code == pytest.approx(sum(cosines) / 3, abs=1e-3)


async def test_the_prototype_head_is_deterministic_and_starts_at_the_centroids() -> None:
    first, second = router("prototype"), router("prototype")
    a, b = await first.prepare(), await second.prepare()
    assert a.head is not None and b.head is not None
    for name in ("prototypes", "centroids"):
        assert np.array_equal(a.head.arrays[name], b.head.arrays[name])
    assert a.head.key == b.head.key
    untrained = await router(PrototypeScoring(steps=0)).prepare()
    assert untrained.head is not None
    centroids = untrained.head.arrays["centroids"]
    assert np.array_equal(untrained.head.arrays["prototypes"], centroids)
    expected = np.mean(
        [np.asarray(TABLE[u]) / np.linalg.norm(TABLE[u]) for u in ("c1", "c2", "c3")], 0
    )
    assert np.allclose(centroids[0], expected / np.linalg.norm(expected), atol=1e-6)
    # Training moved the prototypes, and they stay unit vectors.
    assert not np.array_equal(a.head.arrays["prototypes"], centroids)
    assert np.allclose(np.linalg.norm(a.head.arrays["prototypes"], axis=1), 1.0, atol=1e-5)


# -- bad input ----------------------------------------------------------------------------


async def test_a_one_utterance_route_keeps_that_vector_as_its_prototype() -> None:
    code, math_, default = clients()
    lone = NamedClient("lone")
    semantic = SemanticRoutingChatClient(
        generator(),
        {code: ["c1", "c2", "c3"], lone: ["lone"], math_: ["m1", "m2"]},
        default,
        scoring="prototype",
    )
    head = (await semantic.prepare()).head
    assert head is not None
    vector = np.asarray(TABLE["lone"], dtype=np.float32)
    assert np.allclose(head.arrays["prototypes"][1], vector / np.linalg.norm(vector), atol=1e-6)
    assert (await semantic.route(user("lone"))).client is lone


async def test_duplicates_a_single_route_and_cancelling_utterances_give_finite_scores() -> None:
    code, _, default = clients()
    gen = FakeEmbeddingGenerator({**TABLE, "anti": [-1.0, -0.1, 0.0]}, fingerprint=FINGERPRINT3)
    for profiles in (
        {code: ["c1", "c1", "c1", "c2"]},  # duplicates, a single route
        {code: ["c1", "anti"], NamedClient("x"): ["m1", "m1"]},  # c1 and anti nearly cancel
    ):
        for mode in ("prototype", "knn"):
            semantic = SemanticRoutingChatClient(gen, profiles, default, scoring=mode)
            for query in ("q_code", "q_math", "q_mid", "q_far"):
                decision = await semantic.route(user(query))
                assert decision.score is not None and math.isfinite(decision.score)
                assert all(math.isfinite(v) for v in decision.scores.values())
                assert decision.winner is not None


@pytest.mark.parametrize("mode", ["prototype", "knn"])
async def test_routes_with_identical_utterances_tie_to_the_route_listed_first(mode: str) -> None:
    first, second, default = NamedClient("first"), NamedClient("second"), NamedClient("d")
    for order in ((first, second), (second, first)):
        profiles = {order[0]: ["c1", "c2"], order[1]: ["c2", "c1"], NamedClient("m"): ["m1", "m2"]}
        semantic = SemanticRoutingChatClient(generator(), profiles, default, scoring=mode)
        for query in ("q_code", "q_mid", "c1"):
            decision = await semantic.route(user(query))
            assert decision.winner is order[0]
            assert decision.scores[order[0]] == decision.scores[order[1]]


# -- persistence --------------------------------------------------------------------------


def entries() -> list[tuple[str, str]]:
    return [("code", u) for u in ("c1", "c2", "c3")] + [("math", u) for u in ("m1", "m2", "m3")]


async def test_the_head_is_saved_with_the_index_and_reused_only_for_the_same_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[dict[str, object]] = []
    original = PrototypeScoring.train

    def counting(self: PrototypeScoring, *args: object) -> object:
        trained.append(self.training_settings())
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PrototypeScoring, "train", counting)
    gen = generator()
    built = await ProfileIndex.load_or_build(tmp_path, gen, entries(), scoring=PrototypeScoring())
    assert built.head is not None and len(trained) == 1
    assert (tmp_path / "head.npz").exists()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["head"]["mode"] == "prototype" and manifest["head"]["key"] == built.head.key
    assert manifest["head"]["settings"]["steps"] == 50

    loaded = await ProfileIndex.load_or_build(tmp_path, gen, entries(), scoring=PrototypeScoring())
    assert len(trained) == 1 and loaded.head is not None  # reused, not retrained
    assert np.array_equal(loaded.head.arrays["prototypes"], built.head.arrays["prototypes"])
    assert loaded.train_seconds == built.train_seconds

    # Other settings: retrained, logged, saved.
    with caplog.at_level(logging.WARNING, logger="chatroute.index"):
        other = await ProfileIndex.load_or_build(
            tmp_path, gen, entries(), scoring=PrototypeScoring(steps=7)
        )
    assert len(trained) == 2 and other.head is not None and other.head.key != built.head.key
    assert "retraining" in caplog.text
    assert json.loads((tmp_path / "manifest.json").read_text())["head"]["settings"]["steps"] == 7

    # Other profiles: retrained too (the key covers the vectors and the routes).
    changed = [*entries()[:-1], ("code", "m3")]
    moved = await ProfileIndex.load_or_build(
        tmp_path, gen, changed, scoring=PrototypeScoring(steps=7)
    )
    assert len(trained) == 3 and moved.head is not None and moved.head.key != other.head.key

    # A mode that does not train leaves no head behind.
    plain = await ProfileIndex.load_or_build(tmp_path, gen, changed, scoring=TopKScoring())
    assert plain.head is None
    assert json.loads((tmp_path / "manifest.json").read_text())["head"] is None


async def test_a_router_retrains_a_stale_head_it_is_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gen = generator()
    stale = await ProfileIndex.load_or_build(
        tmp_path, gen, entries(), scoring=PrototypeScoring(steps=3)
    )
    semantic = router("prototype", gen=gen, profile_index=ProfileIndex.load(tmp_path, gen))
    with caplog.at_level(logging.WARNING, logger="chatroute.index"):
        ready = await semantic.prepare()
    assert "retraining" in caplog.text
    assert ready.head is not None and stale.head is not None
    assert ready.head.key != stale.head.key and ready.head.settings["steps"] == 50
    fresh = await router("prototype", gen=generator()).prepare()
    assert fresh.head is not None and ready.head.key == fresh.head.key
    # A matching head is used as it is.
    again = router("prototype", gen=gen, profile_index=ready)
    assert (await again.prepare()).head is ready.head


async def test_a_damaged_saved_head_is_ignored_logged_and_retrained(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gen = generator()
    built = await ProfileIndex.load_or_build(tmp_path, gen, entries(), scoring=PrototypeScoring())
    np.savez(tmp_path / "head.npz", prototypes=np.full((2, 3), np.nan, dtype=np.float32))
    with caplog.at_level(logging.WARNING, logger="chatroute.index"):
        loaded = ProfileIndex.load(tmp_path, gen)
    assert loaded.head is None and "ignoring the saved scoring head" in caplog.text
    rebuilt = await ProfileIndex.load_or_build(tmp_path, gen, entries(), scoring=PrototypeScoring())
    assert rebuilt.head is not None and built.head is not None
    assert np.array_equal(rebuilt.head.arrays["prototypes"], built.head.arrays["prototypes"])
    assert ProfileIndex.load(tmp_path, gen).head is not None  # saved back, whole


# -- calibration and config ---------------------------------------------------------------


async def test_calibrate_tries_each_out_of_scope_score_and_reports_the_choice() -> None:
    semantic = router("prototype")
    code, math_ = semantic.clients[1], semantic.clients[2]
    examples = [("q_code", code), ("q_math", math_), ("q_mid", code), ("q_far", None), ("", None)]
    result = await calibrate(semantic, examples)
    report = result.report
    assert report.scoring == "prototype" and result.oos_score in PrototypeScoring.oos_scores
    assert set(report.oos_score_objectives or {}) == set(PrototypeScoring.oos_scores)
    assert result.scoring is not None and result.scoring.oos_score == result.oos_score
    assert "out-of-scope score" in str(report)
    assert report.after.overall_accuracy >= report.before.overall_accuracy - 1e-9
    tuned = SemanticRoutingChatClient(
        semantic.embedding_generator,
        dict(zip(semantic.clients[1:], (["c1", "c2", "c3"], ["m1", "m2", "m3"]), strict=True)),
        semantic.default_client,
        scoring=result.scoring,
        route_thresholds=result.thresholds,
    )
    decisions = await tuned.route_batch(["q_code", "q_math", "q_far"])
    assert [d.client.name for d in decisions] == ["code", "math", "default"]
    # top_k has one out-of-scope score: calibration is what it always was.
    top_k = router()
    code, math_ = top_k.clients[1], top_k.clients[2]
    examples = [("q_code", code), ("q_math", math_), ("q_mid", code), ("q_far", None)]
    plain = await calibrate(top_k, examples)
    assert plain.oos_score == "aggregate" and plain.report.oos_score_objectives == {
        "aggregate": pytest.approx(plain.report.after.balanced_accuracy)
    }


def test_the_service_config_defaults_to_prototype_and_checks_the_oos_score() -> None:
    data = {
        "routing": {"default_route": "general"},
        "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
        "routes": {"general": {"utterances": ["hello"], "targets": ["p"]}},
    }
    config: ChatrouteConfig = parse_config(data, environ={})
    assert config.routing.scoring == "prototype" and config.routing.oos_score is None
    data["routing"] = {"default_route": "general", "scoring": "knn", "oos_score": "centroid"}
    with pytest.raises(ConfigError, match=r"routing\.oos_score") as caught:
        parse_config(data, environ={})
    assert "'route', 'nearest'" in str(caught.value) or "route, nearest" in str(caught.value)
    data["routing"] = {"default_route": "general", "scoring": "best"}
    with pytest.raises(ConfigError, match=r"routing\.scoring"):
        parse_config(data, environ={})
