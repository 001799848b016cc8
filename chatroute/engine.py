"""The routing engine a config describes: providers, per-route failover chains, a routing policy."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from chatroute.chat.client import ChatClient, ConfigureOptionsChatClient
from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.chat.types import ChatMessage
from chatroute.config import ChatrouteConfig, ConfigError, ProviderConfig, RouteResilience
from chatroute.failover.breaker import BreakerSettings, CircuitBreaker, CircuitBreakerRegistry
from chatroute.failover.timeouts import TimeoutChatClient
from chatroute.index import ProfileIndex
from chatroute.precedence import route_configure
from chatroute.router.conversation import ConversationDecision
from chatroute.router.decision import RouteDecision, ScoreAggregation
from chatroute.router.policy import Router
from chatroute.router.scoring import make_scoring
from chatroute.router.semantic import SemanticRoutingChatClient
from chatroute.session.routes import (
    build_session_store,
    context_for,
    provider_family,
    route_client,
)
from chatroute.session.store import SessionStore
from chatroute.tracing import RecordingFailoverChatClient

__all__ = [
    "ROUTING_POLICIES",
    "Engine",
    "RouterFactory",
    "build_embedder",
    "build_engine",
    "build_provider",
    "load_thresholds",
]

logger = logging.getLogger("chatroute.engine")


class Engine:
    """Everything a config describes, built and wired: what the server and the CLI run on.

    `routes` maps each route name to its client (a health-aware failover chain over its
    providers, wrapped to apply the route's options); `chains` maps it to the chain
    itself and `resilience` to the failover settings in force for it; `breakers` holds
    one circuit breaker per provider, shared by every route. `router` is the routing
    policy over the routes that `routing.policy` names (`ROUTING_POLICIES`). `sessions`
    is the sticky-session store (None when `sessions.enabled` is off). The engine owns the
    providers, the embedding generator and the session store and closes them in
    `aclose()`; the route chains and the routing policy own nothing.
    """

    def __init__(
        self,
        config: ChatrouteConfig,
        embedder: EmbeddingGenerator,
        routes: Mapping[str, ChatClient],
        providers: Mapping[str, ChatClient],
        provider_models: Mapping[str, str],
        *,
        secrets: Sequence[str] = (),
        route_thresholds: Mapping[str, float] | None = None,
        breakers: CircuitBreakerRegistry | None = None,
        chains: Mapping[str, RecordingFailoverChatClient] | None = None,
        sessions: SessionStore | None = None,
    ) -> None:
        self.config = config
        self.embedder = embedder
        self.routes: Mapping[str, ChatClient] = dict(routes)
        self.providers: Mapping[str, ChatClient] = dict(providers)
        self.provider_models: Mapping[str, str] = dict(provider_models)
        self.secrets: tuple[str, ...] = tuple(secrets)
        self.route_thresholds: Mapping[str, float] = dict(route_thresholds or {})
        self.breakers = breakers if breakers is not None else CircuitBreakerRegistry()
        self.chains: Mapping[str, RecordingFailoverChatClient] = dict(chains or {})
        self.sessions = sessions
        self.resilience: Mapping[str, RouteResilience] = {
            name: config.resilience.for_route(route) for name, route in config.routes.items()
        }
        self._names = {id(client): name for name, client in self.routes.items()}
        self._closed = False
        self.router = self.make_router()

    @property
    def default_route(self) -> str:
        """The route that serves requests no profile matches."""
        return self.config.routing.default_route

    def route_name(self, client: ChatClient) -> str:
        """The configured name of a route client."""
        try:
            return self._names[id(client)]
        except KeyError:
            raise RuntimeError(f"{client!r} is not a route of this engine") from None

    def describe(self, decision: RouteDecision, *, matches: bool = False) -> dict[str, Any]:
        """A decision as JSON-ready data: route name, score, per-route scores, default flag."""
        body: dict[str, Any] = {
            "route": self.route_name(decision.client),
            "score": decision.score,
            "scores": {self.route_name(c): s for c, s in decision.scores.items()},
            "is_default": decision.is_default,
            "scoring": decision.scoring,
        }
        if isinstance(decision, ConversationDecision):
            body.update(_describe_turn(decision, self.route_name))
        if matches:
            body["matches"] = [
                {"route": self.route_name(m.client), "utterance": m.utterance, "score": m.score}
                for m in decision.matches
            ]
        return body

    async def decide(self, messages: Sequence[ChatMessage]) -> RouteDecision:
        """The routing policy's decision for a conversation (no provider is called)."""
        return await self.router.route(messages)

    async def decide_batch(self, queries: Sequence[str]) -> list[RouteDecision]:
        """Decisions for many query texts, as one embedding batch and one search.

        A query that carries the conversation it ends (a `messages` attribute, as bulk
        classification's messages rows do) is decided in that conversation, as
        `decide_conversations` decides it; the others as plain texts.
        """
        talks = [
            position
            for position, query in enumerate(queries)
            if getattr(query, "messages", None) is not None
        ]
        if not talks:
            return await self.router.route_batch(queries)
        in_talk = set(talks)
        plain = [position for position in range(len(queries)) if position not in in_talk]
        decisions: list[RouteDecision | None] = [None] * len(queries)
        found = await self.decide_conversations(
            [getattr(queries[position], "messages") for position in talks]  # noqa: B009
        )
        for position, decision in zip(talks, found, strict=True):
            decisions[position] = decision
        if plain:
            found = await self.router.route_batch([queries[position] for position in plain])
            for position, decision in zip(plain, found, strict=True):
                decisions[position] = decision
        return [decision for decision in decisions if decision is not None]

    async def decide_conversations(
        self, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[RouteDecision]:
        """Each conversation's last user turn decided in its context (`routing.context`),
        as one batch when the policy supports it."""
        batch = getattr(self.router, "route_conversations", None)
        if callable(batch):
            decisions: list[RouteDecision] = await batch(conversations)
            return decisions
        return [await self.router.route(messages) for messages in conversations]

    def profile_entries(self) -> list[tuple[str, str]]:
        """The (route name, utterance) pairs of every route, in the router's profile order."""
        return [
            (name, utterance)
            for name, route in self.config.routes.items()
            for utterance in route.utterances
        ]

    def make_router(self, profile_index: ProfileIndex | None = None) -> Router:
        """The configured routing policy over the routes, optionally on a prebuilt profile
        index."""
        return ROUTING_POLICIES[self.config.routing.policy](self, profile_index)

    async def prepare(self) -> None:
        """Load the persisted profile index when `routing.index_path` is set.

        Only new or changed utterances are embedded, and the index is saved back when it
        changed. Without an index path the router builds its index on first use.
        """
        index_path = self.config.routing.index_path
        router = self.router
        if (
            index_path is not None
            and isinstance(router, SemanticRoutingChatClient)
            and router.profile_index is None
        ):
            index = await ProfileIndex.load_or_build(
                index_path, self.embedder, self.profile_entries(), scoring=router.scoring
            )
            self.router = self.make_router(index)

    async def warm(self) -> None:
        """Load the model and build (or load) the profile index now, not on first use."""
        await self.prepare()
        await self.router.route_batch(["warm up the router"])

    async def aclose(self) -> None:
        """Close the providers and the embedding generator; idempotent."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        closables: list[ChatClient | EmbeddingGenerator | SessionStore] = [
            *self.providers.values(),
            self.embedder,
        ]
        if self.sessions is not None:
            closables.append(self.sessions)
        for item in closables:
            try:
                await item.aclose()
            except Exception as exc:
                logger.warning("closing %s failed: %s", type(item).__name__, type(exc).__name__)
                first = first or exc
        if first is not None:
            raise first


def _describe_turn(
    decision: ConversationDecision, name: Callable[[ChatClient], str]
) -> dict[str, Any]:
    """A conversation decision's own fields as JSON-ready data: `outcome` (new, kept or
    switched), the route the conversation was on and the best other route, each with its
    score on this turn (None when there is none), and how many user turns were read."""
    return {
        "outcome": decision.outcome,
        "conversation_route": (
            None if decision.conversation_client is None else name(decision.conversation_client)
        ),
        "conversation_score": decision.conversation_score,
        "challenger_route": (
            None if decision.challenger_client is None else name(decision.challenger_client)
        ),
        "challenger_score": decision.challenger_score,
        "turns_read": decision.turns_read,
    }


class RouterFactory(Protocol):
    """Builds a routing policy over an engine's routes (on a prebuilt profile index, when
    the engine loaded one)."""

    def __call__(self, engine: Engine, profile_index: ProfileIndex | None) -> Router: ...


def semantic_router(engine: Engine, profile_index: ProfileIndex | None) -> Router:
    """The `semantic` policy: routes by the similarity of a query to each route's utterances."""
    routing = engine.config.routing
    profiles = {
        engine.routes[name]: list(route.utterances)
        for name, route in engine.config.routes.items()
        if route.utterances
    }
    thresholds = {engine.routes[name]: value for name, value in engine.route_thresholds.items()}
    return SemanticRoutingChatClient(
        engine.embedder,
        profiles,
        engine.routes[routing.default_route],
        score_threshold=routing.score_threshold,
        top_k=routing.top_k,
        score_aggregation=ScoreAggregation(routing.aggregation),
        leave_open=True,
        route_thresholds=thresholds or None,
        profile_index=profile_index,
        scoring=make_scoring(routing.scoring, oos_score=routing.oos_score),
        context=context_for(routing),
    )


ROUTING_POLICIES: dict[str, RouterFactory] = {"semantic": semantic_router}
"""`routing.policy` names -> the factory of that policy: a new policy is one class and a line."""


def build_embedder(config: ChatrouteConfig) -> EmbeddingGenerator:
    """The local sentence-transformer the config names."""
    from chatroute.embedder import SentenceTransformerEmbedder

    settings = config.embedder
    return SentenceTransformerEmbedder(
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_queue=settings.max_queue if settings.max_queue is not None else 100_000,
        tokenizer_threads=settings.tokenizer_threads,
        workers=settings.workers,
        batch_wait_ms=settings.batch_wait_ms,
        pack_width=settings.pack_width,
        solo_threads=settings.solo_threads,
    )


def build_provider(
    name: str, settings: ProviderConfig, environ: Mapping[str, str]
) -> tuple[ChatClient, str, str | None]:
    """One provider client, its model name, and its API key (None when none is configured)."""
    from chatroute.providers.registry import build_from_config, provider_class

    base_url = settings.resolved_base_url(environ)
    model = settings.resolved_model(environ)
    if model is None or (
        base_url is None and provider_class(settings.type).default_base_url is None
    ):
        # checked at load time; guards direct use
        raise ValueError(f"providers.{name}: base_url and model are required")
    api_key: str | None = None
    if settings.api_key_env is not None:
        api_key = environ.get(settings.api_key_env) or None
        if api_key is None:
            logger.info(
                "providers.%s: %s is not set in the environment; requests carry no API key",
                name,
                settings.api_key_env,
            )
    client = build_from_config(name, settings, model=model, base_url=base_url, api_key=api_key)
    return client, model, api_key


def build_engine(
    config: ChatrouteConfig,
    *,
    embedder: EmbeddingGenerator | None = None,
    providers: Mapping[str, ChatClient] | None = None,
    environ: Mapping[str, str] | None = None,
    breakers: CircuitBreakerRegistry | None = None,
) -> Engine:
    """Build the providers, the route chains and the semantic router a config describes.

    Nothing goes over the network and the model is not loaded here; `Engine.warm()` does
    that. `embedder` replaces the configured generator and `providers` replaces configured
    providers by name (for custom clients); the engine owns and closes what it is given.
    `breakers` is kept (with the state of each provider's breaker) when its settings are
    the config's, as a reload does.
    """
    env = os.environ if environ is None else environ
    problems = config.check(env)
    if config.routing.policy not in ROUTING_POLICIES:
        known = ", ".join(ROUTING_POLICIES)
        problems.append(
            ("routing.policy", f"unknown routing policy {config.routing.policy!r}: use {known}")
        )
    if problems:
        raise ConfigError(problems)
    given = dict(providers or {})
    clients: dict[str, ChatClient] = {}
    models: dict[str, str] = {}
    secrets: list[str] = []
    used = {target for route in config.routes.values() for target in route.targets}
    for name, settings in config.providers.items():
        if name not in used:
            continue
        if name in given:
            clients[name] = given[name]
            models[name] = settings.resolved_model(env) or name
            continue
        provider, model, key = build_provider(name, settings, env)
        clients[name] = provider
        models[name] = model
        if key:
            secrets.append(key)
    breaker = config.resilience.breaker
    breaker_settings = BreakerSettings(
        failure_rate_threshold=breaker.failure_rate_threshold,
        minimum_requests=breaker.minimum_requests,
        window=breaker.window,
        cool_down=breaker.cool_down,
    )
    keep = breakers is not None and breakers.settings == breaker_settings
    registry = (
        breakers if breakers is not None and keep else CircuitBreakerRegistry(breaker_settings)
    )
    routes: dict[str, ChatClient] = {}
    chains: dict[str, RecordingFailoverChatClient] = {}
    store = build_session_store(config, env)
    families = {name: provider_family(config.providers[name].type) for name in clients}
    for route_name, route in config.routes.items():
        policy = config.resilience.for_route(route)
        members = [
            (t, _route_client(clients[t], config.providers[t], policy, built=t not in given))
            for t in route.targets
        ]
        windows: dict[str, int] = {}
        for target in route.targets:
            window = config.providers[target].context_window
            if window is not None:
                windows[target] = window
        make_chain = functools.partial(_failover_chain, route_name, policy, windows, registry.get)
        client, chain = route_client(
            route_name, members, families, make_chain, store=store, breakers=registry
        )
        chains[route_name] = chain
        configure = route_configure(route)  # its options as defaults, then its override
        routes[route_name] = (
            client if configure is None else ConfigureOptionsChatClient(client, configure)
        )
    generator = embedder if embedder is not None else build_embedder(config)
    thresholds = (
        load_thresholds(config.routing.thresholds_file, config)
        if config.routing.thresholds_file
        else None
    )
    try:
        return Engine(
            config,
            generator,
            routes,
            clients,
            models,
            secrets=secrets,
            route_thresholds=thresholds,
            breakers=registry,
            chains=chains,
            sessions=store,
        )
    except ValueError as exc:  # thresholds out of range for the aggregation
        raise ConfigError([("routing.thresholds_file", str(exc))]) from None


def _failover_chain(
    route: str,
    policy: RouteResilience,
    windows: Mapping[str, int],
    breakers: Callable[[str], CircuitBreaker],
    members: Sequence[tuple[str, ChatClient]],
) -> RecordingFailoverChatClient:
    """A route's health-aware failover chain over (provider name, client) pairs, in order."""
    return RecordingFailoverChatClient(
        route,
        [client for _, client in members],
        [name for name, _ in members],
        leave_open=True,
        breaker_factory=breakers,
        retry_same_client=policy.retry_same_provider,
        max_tries_per_client=policy.max_tries_per_provider,
        retry_backoff=policy.retry_backoff,
        retry_after_max=policy.retry_after_max,
        request_deadline=policy.deadline,
        context_windows=dict(windows),
        maximum_attempts_per_request=policy.max_attempts,
    )


def _route_client(
    provider: ChatClient, settings: ProviderConfig, route: RouteResilience, *, built: bool
) -> ChatClient:
    """The client a route calls for one provider: the provider itself, or a view of it
    with the route's time limits.

    Providers built from the config already carry their own limits; a route that
    overrides one gets a view sharing the provider's connection pool (`with_timeouts`).
    A provider given to `build_engine` is wrapped in a `TimeoutChatClient` with the
    limits in force (the route's over the provider config's).
    """
    overrides = {
        "request_timeout": route.attempt,
        "first_token_timeout": route.first_token,
        "stall_timeout": route.stall,
    }
    with_timeouts = getattr(provider, "with_timeouts", None)
    if built and callable(with_timeouts):
        changed = {key: value for key, value in overrides.items() if value is not None}
        if not changed:
            return provider
        view = with_timeouts(**changed)
        if not isinstance(view, ChatClient):
            raise TypeError(f"{type(provider).__name__}.with_timeouts returned {view!r}")
        return view
    own = settings.timeouts
    attempt = route.attempt if route.attempt is not None else own.attempt
    first_token = route.first_token if route.first_token is not None else own.first_token
    stall = route.stall if route.stall is not None else own.stall
    if attempt is None and first_token is None and stall is None:
        return provider
    return TimeoutChatClient(
        provider,
        attempt_timeout=attempt,
        first_token_timeout=first_token,
        stall_timeout=stall,
        leave_open=True,
    )


def load_thresholds(path: str, config: ChatrouteConfig) -> dict[str, float]:
    """Per-route thresholds from a file written by `chatroute fit`; ConfigError if unusable."""
    where = "routing.thresholds_file"
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([(where, f"cannot read {path}: {exc.strerror or exc}")]) from None
    except ValueError as exc:
        raise ConfigError([(where, f"{path} is not valid JSON: {exc}")]) from None
    table = document.get("thresholds") if isinstance(document, dict) else None
    if not isinstance(table, dict):
        raise ConfigError([(where, f"{path} has no 'thresholds' object")])
    problems: list[tuple[str, str]] = []
    thresholds: dict[str, float] = {}
    for name, value in table.items():
        if name not in config.routes:
            problems.append((f"{where}.{name}", "unknown route"))
        elif not config.routes[name].utterances and name != config.routing.default_route:
            problems.append((f"{where}.{name}", "the route has no utterances"))
        elif isinstance(value, bool) or not isinstance(value, int | float):
            problems.append((f"{where}.{name}", f"not a number: {value!r}"))
        else:
            thresholds[name] = float(value)
    if problems:
        raise ConfigError(problems)
    return thresholds
