"""Routing: one selection per request, by callback or by semantic similarity."""

from chatroute.router.base import RoutingChatClient
from chatroute.router.calibration import (
    CalibrationMetrics,
    CalibrationReport,
    CalibrationResult,
    ProfileOverlapWarning,
    apply_thresholds,
    calibrate,
    evaluate_decisions,
    fit_route_thresholds,
)
from chatroute.router.context import RoutingContext
from chatroute.router.conversation import (
    ContextPolicy,
    ConversationDecision,
    ConversationPolicy,
    LastUserPolicy,
    RouteScorer,
    TurnOutcome,
    context_policy,
)
from chatroute.router.decision import RouteDecision, RouteMatch, ScoreAggregation
from chatroute.router.policy import Router
from chatroute.router.scoring import (
    SCORING_MODES,
    AdapterScoring,
    KnnScoring,
    PrototypeScoring,
    ScoringMode,
    TopKScoring,
    make_scoring,
)
from chatroute.router.semantic import SemanticRoutingChatClient

__all__ = [
    "SCORING_MODES",
    "AdapterScoring",
    "CalibrationMetrics",
    "CalibrationReport",
    "CalibrationResult",
    "ContextPolicy",
    "ConversationDecision",
    "ConversationPolicy",
    "KnnScoring",
    "LastUserPolicy",
    "ProfileOverlapWarning",
    "PrototypeScoring",
    "RouteDecision",
    "RouteMatch",
    "RouteScorer",
    "Router",
    "RoutingChatClient",
    "RoutingContext",
    "ScoreAggregation",
    "ScoringMode",
    "SemanticRoutingChatClient",
    "TopKScoring",
    "TurnOutcome",
    "apply_thresholds",
    "calibrate",
    "context_policy",
    "evaluate_decisions",
    "fit_route_thresholds",
    "make_scoring",
]
