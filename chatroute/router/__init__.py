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
from chatroute.router.decision import RouteDecision, RouteMatch, ScoreAggregation
from chatroute.router.policy import Router
from chatroute.router.semantic import SemanticRoutingChatClient

__all__ = [
    "CalibrationMetrics",
    "CalibrationReport",
    "CalibrationResult",
    "ProfileOverlapWarning",
    "RouteDecision",
    "RouteMatch",
    "Router",
    "RoutingChatClient",
    "RoutingContext",
    "ScoreAggregation",
    "SemanticRoutingChatClient",
    "apply_thresholds",
    "calibrate",
    "evaluate_decisions",
    "fit_route_thresholds",
]
