"""Semantic routing results: the score aggregation modes, matched utterances and decisions."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from chatroute.chat.client import ChatClient

__all__ = ["RouteDecision", "RouteMatch", "ScoreAggregation"]


class ScoreAggregation(Enum):
    """How the scores of one client's hits inside the global top-K combine."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"


@dataclass(frozen=True)
class RouteMatch:
    """One profile hit of the global top-K: its client, utterance, cosine score and position."""

    client: ChatClient
    utterance: str
    score: float
    profile_index: int


@dataclass(frozen=True)
class RouteDecision:
    """The outcome of semantic routing for one query.

    - `client`: the selected client (the default client when `is_default`).
    - `is_default`: True only when the fallback chose the client: a blank query, a
      zero-norm query embedding, or a winner whose aggregate fell below its threshold.
    - `score`: the winner's aggregate, reported even below the threshold; None when no
      search ran.
    - `scores`: client -> aggregate for every client with a hit in the top-K, in order of
      first appearance in the ranking; empty when no search ran.
    - `matches`: the top-K hits in rank order; empty when no search ran.
    - `winner`: the client with the best aggregate, whether or not it passed; None when no
      search ran.
    - `threshold`: the threshold the winner's aggregate was compared with; None when no
      search ran.
    - `scoring`: the name of the scoring mode that made the decision ("top_k", "knn",
      "prototype", ...).

    With a scoring mode other than "top_k", `score` is the winner's out-of-scope score
    (the one its threshold is compared with), `scores` holds the best routes' scores
    (the winner first, then by score) and `matches` the `top_k` nearest utterances.
    """

    client: ChatClient
    score: float | None = None
    scores: dict[ChatClient, float] = field(default_factory=dict)
    matches: tuple[RouteMatch, ...] = ()
    is_default: bool = True
    winner: ChatClient | None = None
    threshold: float | None = None
    scoring: str = "top_k"
