"""Calibration: fit per-route thresholds for a semantic router from labelled example queries.

Model. A route r gets the threshold `t_r = mu_r + c`:

- `mu_r` is the mean winning score of the fitting queries that the router sends to r and
  that belong to r, shrunk toward the mean over all routes with `prior_strength`
  pseudo-queries (`(n_r * mean_r + k * mean) / (n_r + k)`). Routes whose genuine queries
  score high get a stricter bar; a route with few or no examples falls back to the
  overall mean.
- `c` is one offset shared by all routes, chosen to maximise the weighted accuracy over
  the fitting queries. "No route" examples are usually scarce, so they are pooled across
  routes through `c` rather than split route by route, and they are weighted to make up
  `no_route_share` of the total weight (0.5 by default: recognising a query that has no
  route counts as much as routing the others; pass your traffic's real share if known).

The fit is deterministic: no sampling, ties between equally good offsets go to the middle
candidate. It only re-thresholds decisions: the winning route of a query never changes,
so the in-scope top-1 accuracy is the ceiling of the in-scope accuracy.

Out-of-scope score. `calibrate` fits thresholds once for each out-of-scope score the
router's scoring mode offers (`ScoringMode.oos_scores`: for "prototype" the winner's
prototype cosine, its centroid cosine, the nearest profile's cosine and the mean of the
three, "blend"; for "knn" the winner's score and the nearest profile's cosine; "top_k"
has only its aggregate), on one embedding of the examples, and keeps the one whose fit
scores best on the fit's own objective (the weighted accuracy; the mode's default wins
ties). The result names it
(`oos_score`, and `scoring`: the router's mode gating on it) and the report gives every
candidate's objective.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from chatroute.chat.client import ChatClient
from chatroute.router.decision import RouteDecision
from chatroute.router.scoring import ScoringMode
from chatroute.router.semantic import SemanticRoutingChatClient

__all__ = [
    "CalibrationMetrics",
    "CalibrationReport",
    "CalibrationResult",
    "ProfileOverlapWarning",
    "apply_thresholds",
    "calibrate",
    "evaluate_decisions",
    "fit_route_thresholds",
]

Label = ChatClient | None


class ProfileOverlapWarning(UserWarning):
    """Some fitting queries are profile utterances themselves, which inflates their scores."""


@dataclass(frozen=True)
class CalibrationMetrics:
    """Accuracy of a set of decisions against labels.

    - `in_scope_top1`: share of labelled (routable) queries whose best-scoring route is the
      label, before any threshold.
    - `in_scope_accuracy`: share of labelled queries sent to their label.
    - `no_route_recall`: share of "no route" queries sent to the default client.
    - `overall_accuracy`: share of all queries sent where their label says (the default
      client for "no route").
    - `balanced_accuracy`: the mean of `in_scope_accuracy` and `no_route_recall` (what the
      fit maximises with the default `no_route_share=0.5`).

    A share with no queries to count is NaN.
    """

    examples: int
    in_scope: int
    no_route: int
    in_scope_top1: float
    in_scope_accuracy: float
    no_route_recall: float
    overall_accuracy: float
    balanced_accuracy: float


@dataclass(frozen=True)
class CalibrationReport:
    """The fitting data's accuracy before (the router's thresholds) and after the fit."""

    before: CalibrationMetrics
    after: CalibrationMetrics
    offset: float
    no_route_share: float | None
    prior_strength: float
    profile_overlaps: int
    scoring: str = "top_k"
    oos_score: str | None = None
    oos_score_objectives: dict[str, float] | None = None

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the report."""
        return asdict(self)

    def __str__(self) -> str:
        rows = [
            ("queries", self.before.examples, self.after.examples),
            ("in-scope top-1", self.before.in_scope_top1, self.after.in_scope_top1),
            ("in-scope accuracy", self.before.in_scope_accuracy, self.after.in_scope_accuracy),
            ("no-route recall", self.before.no_route_recall, self.after.no_route_recall),
            ("overall accuracy", self.before.overall_accuracy, self.after.overall_accuracy),
            ("balanced accuracy", self.before.balanced_accuracy, self.after.balanced_accuracy),
        ]
        lines = [f"{'metric':<20}{'before':>10}{'after':>10}"]
        for name, before, after in rows:
            lines.append(f"{name:<20}{_fmt(before):>10}{_fmt(after):>10}")
        tried = self.oos_score_objectives or {}
        if len(tried) > 1:
            scores = ", ".join(f"{name} {_fmt(value)}" for name, value in tried.items())
            lines.append(f"scoring {self.scoring}: out-of-scope score {self.oos_score} ({scores})")
        return "\n".join(lines)


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted thresholds (pass them as `route_thresholds=`) and the report."""

    thresholds: dict[ChatClient, float]
    report: CalibrationReport
    scoring: ScoringMode | None = None

    @property
    def oos_score(self) -> str | None:
        """The out-of-scope score the thresholds were fitted for (None: not known)."""
        return self.report.oos_score

    def thresholds_by_name(self, routes: Mapping[str, ChatClient]) -> dict[str, float]:
        """The thresholds keyed by route name, for the names in `routes` that have one."""
        return {
            name: self.thresholds[client]
            for name, client in routes.items()
            if client in self.thresholds
        }


async def calibrate(
    router: SemanticRoutingChatClient,
    examples: Sequence[tuple[str, str | ChatClient | None]],
    routes: Mapping[str, ChatClient] | None = None,
    *,
    no_route_share: float | None = 0.5,
    prior_strength: float = 10.0,
) -> CalibrationResult:
    """Route `examples` (text, label) with `router.route_batch` and fit per-route thresholds.

    A label is a route name from `routes`, a client, or None for "no route" (the default
    client should answer). Warns with `ProfileOverlapWarning` when example texts are
    profile utterances. See the module docstring for the model.
    """
    if router is None:
        raise TypeError("router must not be None")
    if not isinstance(router, SemanticRoutingChatClient):
        raise TypeError("router must be a SemanticRoutingChatClient")
    texts, labels = _split_examples(examples, routes)
    utterances = {utterance for _, utterance in router.profiles}
    overlaps = sum(1 for text in texts if text in utterances)
    mode = router.scoring
    candidates = await _decisions_per_oos_score(router, texts)
    results: dict[str, CalibrationResult] = {}
    objectives: dict[str, float] = {}
    for position, (name, decisions) in enumerate(candidates.items()):
        fitted = _fit(
            decisions,
            labels,
            default_client=router.default_client,
            routes=router.clients,
            score_limit=router.score_limit,
            no_route_share=no_route_share,
            prior_strength=prior_strength,
            overlaps=overlaps,
            stacklevel=3,
            warn=position == 0,
        )
        results[name] = fitted
        objectives[name] = _objective(fitted.report.after, no_route_share)
    # The router's own score first, so that it wins ties.
    chosen = max(objectives, key=lambda name: (objectives[name], name == mode.oos_score))
    result = results[chosen]
    before = results[mode.oos_score].report.before
    report = replace(
        result.report,
        before=before,
        scoring=mode.name,
        oos_score=chosen,
        oos_score_objectives=objectives,
    )
    return CalibrationResult(result.thresholds, report, mode.with_oos_score(chosen))


def fit_route_thresholds(
    decisions: Sequence[RouteDecision],
    labels: Sequence[Label],
    *,
    default_client: ChatClient,
    routes: Sequence[ChatClient] | None = None,
    score_limit: float = 1.0,
    no_route_share: float | None = 0.5,
    prior_strength: float = 10.0,
    texts: Sequence[str] | None = None,
) -> CalibrationResult:
    """Fit per-route thresholds from decisions (for example from `route_batch`) and labels.

    `labels[i]` is the client that should answer query i, or None for "no route".
    Thresholds are given for every client in `routes` (default: every winner seen) other
    than `default_client`, clipped to `[-score_limit, score_limit]` (`top_k` for SUM
    aggregation, else 1). When `texts` are given, a query whose text equals one of its
    matched utterances triggers a `ProfileOverlapWarning`.
    """
    if decisions is None or labels is None:
        raise TypeError("decisions and labels must not be None")
    if default_client is None:
        raise TypeError("default_client must not be None")
    decisions = list(decisions)
    overlaps = 0
    if texts is not None:
        if len(texts) != len(decisions):
            raise ValueError(f"{len(texts)} texts for {len(decisions)} decisions")
        overlaps = sum(
            1
            for text, decision in zip(texts, decisions, strict=True)
            if any(match.utterance == text for match in decision.matches)
        )
    if routes is None:
        seen: dict[int, ChatClient] = {}
        for decision in decisions:
            if decision.winner is not None:
                seen.setdefault(id(decision.winner), decision.winner)
        routes = list(seen.values())
    return _fit(
        decisions,
        list(labels),
        default_client=default_client,
        routes=routes,
        score_limit=score_limit,
        no_route_share=no_route_share,
        prior_strength=prior_strength,
        overlaps=overlaps,
        stacklevel=3,
    )


def apply_thresholds(
    decision: RouteDecision,
    thresholds: Mapping[ChatClient, float],
    default_client: ChatClient,
    *,
    fallback_threshold: float | None = None,
) -> ChatClient:
    """The client `decision` would select under `thresholds` (no re-embedding needed).

    A winner missing from `thresholds` keeps the threshold it was judged by, unless
    `fallback_threshold` is given.
    """
    if decision.winner is None or decision.score is None:
        return decision.client
    threshold = thresholds.get(decision.winner)
    if threshold is None:
        threshold = fallback_threshold if fallback_threshold is not None else decision.threshold
    if threshold is None or decision.score >= threshold:
        return decision.winner
    return default_client


def evaluate_decisions(
    decisions: Sequence[RouteDecision],
    labels: Sequence[Label],
    *,
    default_client: ChatClient,
    thresholds: Mapping[ChatClient, float] | None = None,
) -> CalibrationMetrics:
    """Accuracy of `decisions` against `labels`, re-thresholded by `thresholds` if given."""
    if decisions is None or labels is None:
        raise TypeError("decisions and labels must not be None")
    if default_client is None:
        raise TypeError("default_client must not be None")
    decisions = list(decisions)
    labels = list(labels)
    if len(decisions) != len(labels):
        raise ValueError(f"{len(labels)} labels for {len(decisions)} decisions")
    if thresholds is None:
        chosen = [decision.client for decision in decisions]
    else:
        chosen = [apply_thresholds(d, thresholds, default_client) for d in decisions]
    return _metrics(decisions, labels, chosen, default_client)


# -- internals ----------------------------------------------------------------------------


async def _decisions_per_oos_score(
    router: SemanticRoutingChatClient, texts: list[str]
) -> dict[str, list[RouteDecision]]:
    """The decisions on `texts` under each out-of-scope score, from one embedding call."""
    mode = router.scoring
    names = [mode.oos_score, *(name for name in mode.oos_scores if name != mode.oos_score)]
    if len(names) == 1:
        return {names[0]: await router.route_batch(texts)}
    usable = [position for position, text in enumerate(texts) if text and not text.isspace()]
    fallback = await router.route_batch([""])
    raw = None
    if usable:
        await router.prepare()
        raw = await router.embedding_generator.generate([texts[p] for p in usable])
    out: dict[str, list[RouteDecision]] = {}
    for name in names:
        decisions = [fallback[0]] * len(texts)
        if raw is not None:
            for position, decision in zip(
                usable, await router.route_embeddings(raw, oos_score=name), strict=True
            ):
                decisions[position] = decision
        out[name] = decisions
    return out


def _objective(metrics: CalibrationMetrics, no_route_share: float | None) -> float:
    """What the fit maximises: the weighted accuracy (plain accuracy without a share)."""
    if no_route_share is None or math.isnan(metrics.no_route_recall):
        return metrics.overall_accuracy
    if math.isnan(metrics.in_scope_accuracy):
        return metrics.no_route_recall
    share = float(no_route_share)
    return (1.0 - share) * metrics.in_scope_accuracy + share * metrics.no_route_recall


def _split_examples(
    examples: Sequence[tuple[str, str | ChatClient | None]],
    routes: Mapping[str, ChatClient] | None,
) -> tuple[list[str], list[Label]]:
    if examples is None:
        raise TypeError("examples must not be None")
    texts: list[str] = []
    labels: list[Label] = []
    for position, example in enumerate(examples):
        try:
            text, label = example
        except (TypeError, ValueError):
            raise TypeError(f"example {position} is not a (text, label) pair")
        if not isinstance(text, str):
            raise TypeError(f"the text of example {position} is {type(text).__name__}, not str")
        if label is None or isinstance(label, ChatClient):
            labels.append(label)
        elif isinstance(label, str):
            if routes is None or label not in routes:
                raise ValueError(f"example {position} names an unknown route {label!r}")
            labels.append(routes[label])
        else:
            raise TypeError(
                f"the label of example {position} must be a route name, a client or None"
            )
        texts.append(text)
    return texts, labels


def _fit(
    decisions: list[RouteDecision],
    labels: list[Label],
    *,
    default_client: ChatClient,
    routes: Sequence[ChatClient],
    score_limit: float,
    no_route_share: float | None,
    prior_strength: float,
    overlaps: int,
    stacklevel: int,
    warn: bool = True,
) -> CalibrationResult:
    if len(decisions) != len(labels):
        raise ValueError(f"{len(labels)} labels for {len(decisions)} decisions")
    if no_route_share is not None and not 0.0 < float(no_route_share) < 1.0:
        raise ValueError(f"no_route_share must be in (0, 1) or None, got {no_route_share}")
    if isinstance(prior_strength, bool) or not prior_strength >= 0.0:
        raise ValueError(f"prior_strength must be a number >= 0, got {prior_strength}")
    if not score_limit > 0.0:
        raise ValueError(f"score_limit must be positive, got {score_limit}")
    if overlaps and warn:
        warnings.warn(
            f"{overlaps} of the {len(decisions)} calibration queries are profile utterances; "
            "they match themselves with a score of about 1 and make the fitted thresholds "
            "too strict. Fit on queries that are not in the profiles.",
            ProfileOverlapWarning,
            stacklevel=stacklevel,
        )
    for decision in decisions:
        if not isinstance(decision, RouteDecision):
            raise TypeError("decisions must be RouteDecision objects")

    # Relevant queries: those whose outcome depends on the winner's threshold.
    scores: list[float] = []
    winners: list[int] = []
    positive: list[bool] = []
    weights: list[float] = []
    in_scope = sum(1 for label in labels if label is not None)
    no_route = len(labels) - in_scope
    if no_route_share is None:
        w_in = w_out = 1.0
    else:
        w_in = (1.0 - no_route_share) / in_scope if in_scope else 0.0
        w_out = no_route_share / no_route if no_route else 0.0
    for decision, label in zip(decisions, labels, strict=True):
        winner, score = decision.winner, decision.score
        if winner is None or score is None or winner is default_client:
            continue
        if label is None:
            scores.append(score)
            winners.append(id(winner))
            positive.append(False)
            weights.append(w_out)
        elif label is winner:
            scores.append(score)
            winners.append(id(winner))
            positive.append(True)
            weights.append(w_in)
    if not any(positive):
        raise ValueError(
            "no calibration query was routed to its labelled route: nothing to fit "
            "(check the labels, or add in-scope examples)"
        )
    if all(positive):
        raise ValueError(
            "calibration needs 'no route' examples (label None) that some route wins; "
            "without them every threshold would fall to the minimum"
        )

    score_arr = np.asarray(scores, dtype=np.float64)
    pos_arr = np.asarray(positive, dtype=bool)
    weight_arr = np.asarray(weights, dtype=np.float64)
    overall_mean = float(score_arr[pos_arr].mean())
    keys = list(dict.fromkeys(winners))
    slot = {key: position for position, key in enumerate(keys)}
    route_of = np.asarray([slot[w] for w in winners], dtype=np.int64)
    counts = np.bincount(route_of[pos_arr], minlength=len(keys))
    sums = np.bincount(route_of[pos_arr], weights=score_arr[pos_arr], minlength=len(keys))
    denominator = counts + prior_strength
    shrunk = np.full(len(keys), overall_mean)
    np.divide(sums + prior_strength * overall_mean, denominator, out=shrunk, where=denominator > 0)
    route_mean = {key: float(shrunk[slot[key]]) for key in keys}
    centre = np.asarray([route_mean[w] for w in winners], dtype=np.float64)
    offset = _best_offset(score_arr - centre, pos_arr, weight_arr)

    thresholds: dict[ChatClient, float] = {}
    for client in routes:
        if client is default_client or client in thresholds:
            continue
        value = route_mean.get(id(client), overall_mean) + offset
        thresholds[client] = float(min(score_limit, max(-score_limit, value)))

    before = _metrics(decisions, labels, [d.client for d in decisions], default_client)
    chosen = [apply_thresholds(d, thresholds, default_client) for d in decisions]
    after = _metrics(decisions, labels, chosen, default_client)
    report = CalibrationReport(
        before=before,
        after=after,
        offset=offset,
        no_route_share=no_route_share,
        prior_strength=float(prior_strength),
        profile_overlaps=overlaps,
        scoring=decisions[0].scoring,
    )
    return CalibrationResult(thresholds=thresholds, report=report)


def _best_offset(residuals: np.ndarray, positive: np.ndarray, weights: np.ndarray) -> float:
    """The offset c maximising sum(w: positive, r >= c) + sum(w: negative, r < c)."""
    order = np.argsort(residuals, kind="stable")
    values = residuals[order]
    pos_w = np.where(positive[order], weights[order], 0.0)
    neg_w = np.where(positive[order], 0.0, weights[order])
    # Candidate j accepts values[j:]: positives kept from j on, negatives rejected before j.
    kept = np.concatenate([np.cumsum(pos_w[::-1])[::-1], [0.0]])
    rejected = np.concatenate([[0.0], np.cumsum(neg_w)])
    objective = kept + rejected
    candidates = np.concatenate(
        [[values[0] - 1e-3], (values[1:] + values[:-1]) / 2.0, [values[-1] + 1e-3]]
    )
    # Equal neighbours give candidates that split nothing; only distinct gaps are real cuts.
    real = np.concatenate([[True], values[1:] > values[:-1], [True]])
    objective = np.where(real, objective, -np.inf)
    best = np.flatnonzero(objective >= objective.max() - 1e-12)
    return float(candidates[best[len(best) // 2]])


def _metrics(
    decisions: list[RouteDecision],
    labels: list[Label],
    chosen: list[ChatClient],
    default_client: ChatClient,
) -> CalibrationMetrics:
    in_scope = top1 = routed = no_route = recalled = 0
    for decision, label, client in zip(decisions, labels, chosen, strict=True):
        if label is None:
            no_route += 1
            recalled += client is default_client
        else:
            in_scope += 1
            top1 += decision.winner is label
            routed += client is label
    total = in_scope + no_route
    in_scope_accuracy = _share(routed, in_scope)
    no_route_recall = _share(recalled, no_route)
    return CalibrationMetrics(
        examples=total,
        in_scope=in_scope,
        no_route=no_route,
        in_scope_top1=_share(top1, in_scope),
        in_scope_accuracy=in_scope_accuracy,
        no_route_recall=no_route_recall,
        overall_accuracy=_share(routed + recalled, total),
        balanced_accuracy=(in_scope_accuracy + no_route_recall) / 2.0,
    )


def _share(count: int, total: int) -> float:
    return count / total if total else math.nan


def _fmt(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return "n/a" if math.isnan(value) else f"{100.0 * value:.1f}%"
