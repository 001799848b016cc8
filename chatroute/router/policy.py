"""The `Router` protocol: what the service and the CLI need from a routing policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from chatroute.chat.client import ChatClient
from chatroute.chat.types import ChatMessage
from chatroute.router.decision import RouteDecision

__all__ = ["Router"]


@runtime_checkable
class Router(Protocol):
    """A routing policy over an engine's routes (`routing.policy` in the config names it).

    It decides one conversation (`route`) or many query texts at once (`route_batch`),
    always among `clients` (the route clients it was built over), falling back to
    `default_client`. `aclose` releases what the policy itself owns; the engine owns the
    routes and the embedder. `SemanticRoutingChatClient` is the `semantic` policy.
    """

    @property
    def clients(self) -> tuple[ChatClient, ...]:
        """The route clients this policy picks from, in profile order."""
        ...

    @property
    def default_client(self) -> ChatClient:
        """The route that serves requests no route matches."""
        ...

    async def route(self, messages: Sequence[ChatMessage]) -> RouteDecision:
        """The decision for one conversation (no provider is called)."""
        ...

    async def route_batch(self, queries: Sequence[str]) -> list[RouteDecision]:
        """Decisions for many query texts, in order."""
        ...

    async def aclose(self) -> None:
        """Release what the policy owns."""
        ...
