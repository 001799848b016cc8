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
from chatroute.router.semantic import SemanticRoutingChatClient

__all__ = [
    "CalibrationMetrics",
    "CalibrationReport",
    "CalibrationResult",
    "ContextPolicy",
    "ConversationDecision",
    "ConversationPolicy",
    "LastUserPolicy",
    "ProfileOverlapWarning",
    "RouteDecision",
    "RouteMatch",
    "RouteScorer",
    "RoutingChatClient",
    "RoutingContext",
    "ScoreAggregation",
    "SemanticRoutingChatClient",
    "TurnOutcome",
    "apply_thresholds",
    "calibrate",
    "context_policy",
    "evaluate_decisions",
    "fit_route_thresholds",
]
