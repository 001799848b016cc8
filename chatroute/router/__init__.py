"""Routing: one selection per request, by callback or by semantic similarity."""

from chatroute.router.base import RoutingChatClient
from chatroute.router.context import RoutingContext

__all__ = ["RoutingChatClient", "RoutingContext"]
