"""Calibration: per-route thresholds fitted on labelled queries, deterministic and checked."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from semantic_doubles import FakeEmbeddingGenerator, NamedClient, user

from chatroute.router import (
    CalibrationResult,
    ProfileOverlapWarning,
    ScoreAggregation,
    SemanticRoutingChatClient,
    apply_thresholds,
    calibrate,
    evaluate_decisions,
    fit_route_thresholds,
)


def toward(axis: int, cosine: float) -> list[float]:
    """A 3-d vector with the given cosine to unit axis `axis` (0 or 1) and 0 to the other."""
    vector = [0.0, 0.0, math.sqrt(1.0 - cosine * cosine)]
    vector[axis] = cosine
    return vector


class Synthetic:
    """Two routes whose genuine queries score differently, so one global threshold fails.

    Route "tight" (axis 0): genuine queries score 0.92-0.98, no-route queries near it 0.70-0.75.
    Route "loose" (axis 1): genuine queries score 0.55-0.65, no-route queries near it 0.30-0.40.
    Any single threshold either rejects loose's genuine queries or accepts tight's strays.
    """

    def __init__(self, per_route: int = 30, strays: int = 8, offset: float = 0.0) -> None:
        self.tight, self.loose, self.default = (
            NamedClient("tight"),
            NamedClient("loose"),
            NamedClient("default"),
        )
        self.routes = {"tight": self.tight, "loose": self.loose}
        self.table: dict[str, list[float]] = {
            "tight profile": [1, 0, 0],
            "loose profile": [0, 1, 0],
        }
        self.examples: list[tuple[str, str | None]] = []
        plan = [
            ("tight", 0, 0.92, 0.98, per_route),
            (None, 0, 0.70, 0.75, strays),
            ("loose", 1, 0.55, 0.65, per_route),
            (None, 1, 0.30, 0.40, strays),
        ]
        for label, axis, low, high, count in plan:
            for i, cosine in enumerate(np.linspace(low + offset, high - offset, count)):
                text = f"{label or 'none'}-{axis}-{i}-{offset}"
                self.table[text] = toward(axis, float(cosine))
                self.examples.append((text, label))
        self.generator = FakeEmbeddingGenerator(self.table)

    def router(self, **kwargs: object) -> SemanticRoutingChatClient:
        return SemanticRoutingChatClient(
            self.generator,
            {self.tight: ["tight profile"], self.loose: ["loose profile"]},
            self.default,
            **kwargs,  # type: ignore[arg-type]
        )

    def labels(self) -> list[NamedClient | None]:
        return [self.routes[label] if label else None for _, label in self.examples]


async def test_calibration_improves_accuracy_on_synthetic_routes() -> None:
    data = Synthetic()
    router = data.router()
    result = await calibrate(router, data.examples, data.routes)
    tight, loose = result.thresholds[data.tight], result.thresholds[data.loose]
    assert 0.75 < tight < 0.92
    assert 0.40 < loose < 0.55
    assert data.default not in result.thresholds
    before, after = result.report.before, result.report.after
    assert before.no_route_recall == 0.0 and before.in_scope_accuracy == 1.0
    assert after.overall_accuracy == 1.0 and after.no_route_recall == 1.0
    assert after.in_scope_top1 == before.in_scope_top1 == 1.0
    assert before.examples == after.examples == 76 and after.no_route == 16

    # Held-out queries from the same distributions, routed by a router built with the fit.
    held_out = Synthetic(per_route=11, strays=5, offset=0.01)
    held_router = held_out.router()
    decisions = await held_router.route_batch([text for text, _ in held_out.examples])
    labels = held_out.labels()
    default_metrics = evaluate_decisions(decisions, labels, default_client=held_out.default)
    mapped = {held_out.tight: tight, held_out.loose: loose}
    fitted_metrics = evaluate_decisions(
        decisions, labels, default_client=held_out.default, thresholds=mapped
    )
    assert default_metrics.no_route_recall == 0.0
    assert fitted_metrics.overall_accuracy == 1.0 > default_metrics.overall_accuracy
    applied = held_out.router(route_thresholds=mapped, profile_index=held_router.profile_index)
    for (text, _), decision in zip(held_out.examples, decisions, strict=True):
        routed = await applied.route(user(text))
        assert routed.client is apply_thresholds(decision, mapped, held_out.default)


async def test_calibration_no_single_threshold_fits_the_synthetic_routes() -> None:
    data = Synthetic()
    decisions = await data.router().route_batch([text for text, _ in data.examples])
    best = max(
        evaluate_decisions(
            decisions,
            data.labels(),
            default_client=data.default,
            thresholds={data.tight: t, data.loose: t},
        ).overall_accuracy
        for t in np.linspace(0.0, 1.0, 201)
    )
    assert best < 1.0


async def test_calibration_is_deterministic() -> None:
    one = Synthetic()
    first = await calibrate(one.router(), one.examples, one.routes)
    data = Synthetic()
    second = await calibrate(data.router(), data.examples, data.routes)
    assert list(first.thresholds.values()) == list(second.thresholds.values())
    assert first.report == second.report
    assert second.thresholds_by_name(data.routes) == {
        "tight": second.thresholds[data.tight],
        "loose": second.thresholds[data.loose],
    }


async def test_calibration_warns_when_fitting_queries_are_profile_utterances() -> None:
    data = Synthetic()
    router = data.router()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await calibrate(router, data.examples, data.routes)
    examples = [*data.examples, ("tight profile", "tight")]
    with pytest.warns(ProfileOverlapWarning, match="1 of the 77"):
        result = await calibrate(router, examples, data.routes)
    assert result.report.profile_overlaps == 1
    decisions = await router.route_batch([text for text, _ in examples])
    labels = [*data.labels(), data.tight]
    with pytest.warns(ProfileOverlapWarning):
        fit_route_thresholds(
            decisions,
            labels,
            default_client=data.default,
            texts=[text for text, _ in examples],
        )


async def test_fit_route_thresholds_from_decisions_matches_calibrate() -> None:
    data = Synthetic()
    router = data.router()
    decisions = await router.route_batch([text for text, _ in data.examples])
    direct = fit_route_thresholds(decisions, data.labels(), default_client=data.default)
    via_router = await calibrate(router, data.examples, data.routes)
    assert isinstance(direct, CalibrationResult)
    assert direct.thresholds == via_router.thresholds
    assert direct.report.after == via_router.report.after


async def test_calibration_weights_no_route_examples_by_share() -> None:
    data = Synthetic()
    decisions = await data.router().route_batch([text for text, _ in data.examples])
    labels = data.labels()
    # Make the strays of "loose" overlap its genuine queries: the share now decides.
    strays = [i for i, (_, label) in enumerate(data.examples) if label is None][8:]
    for i in strays:
        d = decisions[i]
        decisions[i] = type(d)(**{**d.__dict__, "score": 0.6})
    low = fit_route_thresholds(decisions, labels, default_client=data.default, no_route_share=0.05)
    high = fit_route_thresholds(decisions, labels, default_client=data.default, no_route_share=0.95)
    assert low.thresholds[data.loose] < 0.6 < high.thresholds[data.loose]
    assert low.report.after.in_scope_accuracy > high.report.after.in_scope_accuracy
    assert low.report.after.no_route_recall < high.report.after.no_route_recall


async def test_calibration_thresholds_are_clipped_to_the_score_range() -> None:
    data = Synthetic()
    router = data.router(top_k=2, score_aggregation=ScoreAggregation.SUM)
    result = await calibrate(router, data.examples, data.routes)
    limit = 2.0
    assert all(-limit <= t <= limit for t in result.thresholds.values())
    decisions = await router.route_batch([text for text, _ in data.examples])
    clipped = fit_route_thresholds(
        decisions, data.labels(), default_client=data.default, score_limit=0.1
    )
    assert all(t == 0.1 for t in clipped.thresholds.values())


async def test_calibration_rejects_bad_input() -> None:
    data = Synthetic()
    router = data.router()
    in_scope_only = [(t, label) for t, label in data.examples if label is not None]
    with pytest.raises(ValueError, match="no route"):
        await calibrate(router, in_scope_only, data.routes)
    with pytest.raises(ValueError, match="unknown route"):
        await calibrate(router, [("x", "nope")], data.routes)
    with pytest.raises(TypeError):
        await calibrate(router, [(3, "tight")], data.routes)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        await calibrate(router, [("x", 3.5)], data.routes)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        await calibrate(router, ["x"], data.routes)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        await calibrate(None, data.examples, data.routes)  # type: ignore[arg-type]
    for share in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="no_route_share"):
            await calibrate(router, data.examples, data.routes, no_route_share=share)
    decisions = await router.route_batch(["tight-0-0-0.0"])
    with pytest.raises(ValueError, match="labels"):
        fit_route_thresholds(decisions, [], default_client=data.default)
    with pytest.raises(ValueError, match="routed to its labelled route"):
        fit_route_thresholds(decisions, [None], default_client=data.default)


async def test_calibration_report_text_and_dict() -> None:
    data = Synthetic()
    result = await calibrate(data.router(), data.examples, data.routes)
    text = str(result.report)
    assert "overall accuracy" in text and "100.0%" in text and "no-route recall" in text
    as_dict = result.report.to_dict()
    assert as_dict["after"]["overall_accuracy"] == 1.0  # type: ignore[index]
    assert as_dict["no_route_share"] == 0.5
