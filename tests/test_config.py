"""Config loading and validation: errors name the key at fault; the engine is built from it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from chatroute.chat import ChatClient, ChatOptions, ConfigureOptionsChatClient
from chatroute.chat.types import ChatMessage
from chatroute.config import ConfigError, load_config, parse_config
from chatroute.engine import ROUTING_POLICIES, load_thresholds
from chatroute.router import RouteDecision, Router
from chatroute.router.conversation import ConversationPolicy
from chatroute.server import RecordingFailoverChatClient, build_engine
from chatroute.session import (
    HistoryHygieneChatClient,
    InMemorySessionStore,
    StickyProviderChatClient,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "chatroute.yaml"


def base() -> dict[str, Any]:
    return {
        "embedder": {"model": "default", "device": "auto"},
        "routing": {
            "top_k": 5,
            "aggregation": "mean",
            "threshold": 0.3,
            "default_route": "general",
        },
        "providers": {
            "fast": {
                "type": "openai",
                "base_url": "http://127.0.0.1:9001/v1",
                "model": "small-model",
                "api_key_env": "FAST_API_KEY",
            },
            "strong": {"type": "openai", "base_url": "http://127.0.0.1:9002/v1", "model": "big"},
        },
        "routes": {
            "code": {
                "utterances": ["fix this bug", "write a function that"],
                "targets": ["fast", "strong"],
                "options": {"temperature": 0.2},
            },
            "general": {"targets": ["strong"]},
        },
    }


def problems(data: dict[str, Any], environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, environ=environ or {})
    assert isinstance(caught.value, ValueError)
    return [f"{path}: {message}" for path, message in caught.value.problems]


def test_the_issue_example_shape_is_valid() -> None:
    config = parse_config(base(), environ={})
    assert config.routing.default_route == "general"
    assert config.routes["code"].options.temperature == 0.2
    assert config.server.max_body_bytes == 1_048_576  # defaults fill the rest


def test_the_bundled_example_loads() -> None:
    config = load_config(EXAMPLE, environ={})
    assert set(config.routes) >= {"code", "math", "writing", "support", "general"}
    assert all(len(r.utterances) >= 8 for r in config.routes.values())
    assert config.embedder.model == "default"


def test_unknown_provider_is_named_with_its_path() -> None:
    data = base()
    data["routes"]["code"]["targets"] = ["fast", "strongg"]
    assert problems(data) == [
        "routes.code.targets[1]: unknown provider 'strongg' (did you mean 'strong'?)"
    ]


def test_every_problem_is_reported_at_once() -> None:
    data = base()
    data["routing"]["default_route"] = "nowhere"
    data["routes"]["code"]["utterances"] = ["ok", "   "]
    data["routes"]["code"]["options"]["temprature"] = 1
    data["providers"]["fast"]["timeouts"] = {"connect": -1}
    found = problems(data)
    assert "routes.code.utterances[1]: must not be empty or whitespace" in found
    assert "routes.code.options.temprature: unknown key (did you mean 'temperature'?)" in found
    assert any(p.startswith("providers.fast.timeouts.connect:") for p in found)
    # Cross-reference checks run only once the shape is valid.
    data = base()
    data["routing"]["default_route"] = "nowhere"
    assert problems(data) == ["routing.default_route: unknown route 'nowhere'"]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d.pop("routing"), "routing: Field required"),
        (lambda d: d.update(providers={}), "providers: Dictionary should have at least 1 item"),
        (lambda d: d["routes"]["code"].update(targets=[]), "routes.code.targets: List should"),
        (lambda d: d["routing"].update(aggregation="median"), "routing.aggregation: Input"),
        (lambda d: d["routing"].update(threshold=1.5), "routing.threshold: must lie in [-1, 1]"),
        (lambda d: d["routing"].update(top_k=0), "routing.top_k: Input should be greater"),
        (lambda d: d["routes"].update(auto={"targets": ["fast"]}), "routes.auto: 'auto' is"),
        (
            lambda d: d["routes"].update({"bad name!": {"targets": ["fast"]}}),
            "routes['bad name!']: String should match pattern",
        ),
        (lambda d: d["providers"]["fast"].update(type="grpc"), "providers.fast.type"),
        (lambda d: d["providers"]["fast"].pop("model"), "providers.fast.model: required"),
        (
            lambda d: d["providers"]["fast"].update(headers={"Authorization": "Bearer x"}),
            "carries a secret",
        ),
        (lambda d: d["providers"]["fast"].update(api_key="sk-x"), "providers.fast.api_key"),
        (lambda d: d.update(extra=1), "extra: unknown key"),
        (
            lambda d: (
                d["routes"]["code"].update(utterances=[])
                or d["routes"].pop("general")
                or d["routing"].update(default_route="code")
            ),
            "routes: at least one route needs utterances",
        ),
    ],
)
def test_invalid_configs_name_the_key(change: Any, expected: str) -> None:
    data = base()
    change(data)
    found = problems(data)
    assert any(expected in p for p in found), found


def test_sum_aggregation_allows_thresholds_up_to_top_k() -> None:
    data = base()
    data["routing"].update(aggregation="sum", threshold=2.5, top_k=3, scoring="top_k")
    assert parse_config(data, environ={}).routing.threshold == 2.5
    # Sums only exist in top_k scoring: under the service's default mode it is out of range.
    del data["routing"]["scoring"]
    assert any("'prototype' scoring mode" in p for p in problems(data))


def test_yaml_errors_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: {top_k: 5\nproviders: [", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "missing.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(scalar)


def test_environment_overrides_base_url_and_model() -> None:
    data = base()
    data["providers"]["strong"] = {"base_url_env": "STRONG_URL", "model_env": "STRONG_MODEL"}
    assert problems(data) == [
        "providers.strong.base_url: required (or set base_url_env in the env)",
        "providers.strong.model: required (or set model_env in the env)",
    ]
    env = {"STRONG_URL": "http://10.0.0.1:8000/v1", "STRONG_MODEL": "qwen"}
    config = parse_config(data, environ=env)
    provider = config.providers["strong"]
    assert provider.resolved_base_url(env) == "http://10.0.0.1:8000/v1"
    assert provider.resolved_model(env) == "qwen"


def test_relative_paths_resolve_against_the_config_file(tmp_path: Path) -> None:
    data = base()
    data["routing"]["index_path"] = "idx"
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(data), encoding="utf-8")  # JSON is YAML
    assert load_config(path, environ={}).routing.index_path == str(tmp_path / "idx")


def test_route_options_apply_on_a_clone_and_accept_openai_names() -> None:
    data = base()
    data["routes"]["code"]["options"] = {
        "temperature": 0.1,
        "max_tokens": 256,
        "stop": ["###"],
        "reasoning_effort": "high",
        "extra_body": {"top_k": 20},
    }
    options = parse_config(data, environ={}).routes["code"].options
    # A route's options are defaults: what the caller sent stays, the rest is filled in.
    target = ChatOptions(temperature=0.9, additional_properties={"user_flag": 1, "top_k": 5})
    options.apply(target)
    assert target.temperature == 0.9 and target.max_output_tokens == 256
    assert target.stop_sequences == ["###"]
    assert target.reasoning == {"effort": "high"}
    assert target.additional_properties == {"user_flag": 1, "top_k": 5}
    bare = ChatOptions()
    options.apply(bare)
    assert bare.temperature == 0.1 and bare.additional_properties == {"top_k": 20}


def test_a_route_override_forces_its_values_and_names_those_it_changed() -> None:
    from chatroute.precedence import overridden_fields, route_configure

    data = base()
    data["routes"]["code"]["options"] = {"temperature": 0.8, "seed": 1}
    data["routes"]["code"]["override"] = {
        "temperature": 0.2,
        "max_tokens": 100,
        "extra_body": {"top_k": 20},
    }
    route = parse_config(data, environ={}).routes["code"]
    configure = route_configure(route)
    assert configure is not None
    caller = ChatOptions(
        temperature=0.0,
        max_output_tokens=100,
        seed=7,
        additional_properties={"top_k": 40, "min_p": 0.1},
    )
    sent = caller.clone()
    configure(sent)
    assert (sent.temperature, sent.max_output_tokens, sent.seed) == (0.2, 100, 7)
    assert sent.additional_properties == {"top_k": 20, "min_p": 0.1}
    caller.pass_through_fields = frozenset({"top_k", "min_p"})
    sent = caller.clone()
    configure(sent)  # the forced top_k is the operator's: no pass_through setting drops it
    assert sent.pass_through_fields == frozenset({"min_p"})
    # Named: what the caller sent and the override changed (max_tokens was already 100).
    assert overridden_fields(route.override, caller) == ["temperature", "top_k"]
    assert overridden_fields(route.override, ChatOptions()) == []
    assert route_configure(parse_config(base(), environ={}).routes["general"]) is None


def test_a_route_that_sets_only_nulls_configures_nothing() -> None:
    from chatroute.precedence import route_configure

    data = base()
    data["routes"]["code"]["options"] = {"temperature": None}
    data["routes"]["code"]["override"] = {"seed": None, "extra_body": None}
    route = parse_config(data, environ={}).routes["code"]
    assert route.options.is_empty() and route.override.is_empty()
    assert route_configure(route) is None
    data["routes"]["code"]["override"] = {"seed": None, "extra_body": {"top_k": 1}}
    assert not parse_config(data, environ={}).routes["code"].override.is_empty()


def test_engine_builds_chains_wrappers_and_router() -> None:
    config = parse_config(base(), environ={})
    env = {"FAST_API_KEY": "sk-fast-000000"}
    engine = build_engine(config, environ=env, embedder=_NoEmbedder())
    try:
        code, general = engine.routes["code"], engine.routes["general"]
        assert isinstance(code, ConfigureOptionsChatClient)  # the route has options
        # sessions are on by default: each route keeps a conversation on its provider
        assert isinstance(code.inner, StickyProviderChatClient)
        assert isinstance(general, StickyProviderChatClient)
        assert isinstance(engine.sessions, InMemorySessionStore)
        chain = engine.chains["code"]
        assert isinstance(chain, RecordingFailoverChatClient)
        assert [chain.provider_name(c) for c in chain.clients] == ["fast", "strong"]
        # each provider forwards the history its family can take
        families = [_unwrap(c, HistoryHygieneChatClient).family for c in chain.clients]
        assert families == ["openai", "openai"]
        assert engine.router.context.name == "conversation"
        assert engine.router.default_client is general
        assert engine.route_name(code) == "code"
        assert engine.provider_models == {"fast": "small-model", "strong": "big"}
        assert engine.secrets == ("sk-fast-000000",)
        assert [engine.route_name(c) for c in engine.router.clients] == ["general", "code"]
    finally:
        asyncio.run(engine.aclose())


def test_sessions_off_route_is_the_failover_chain_and_last_user_context() -> None:
    data = base()
    data["sessions"] = {"enabled": False}
    data["routing"]["context"] = "last_user"
    engine = build_engine(parse_config(data, environ={}), environ={}, embedder=_NoEmbedder())
    try:
        assert engine.sessions is None
        assert engine.routes["general"] is engine.chains["general"]
        assert engine.router.context.name == "last_user"
    finally:
        asyncio.run(engine.aclose())


def test_conversation_parameters_reach_the_policy_and_bad_ones_name_the_key() -> None:
    data = base()
    data["routing"]["conversation"] = {"window": 3, "switch_cost": 0.2}
    engine = build_engine(parse_config(data, environ={}), environ={}, embedder=_NoEmbedder())
    try:
        policy = engine.router.context
        assert isinstance(policy, ConversationPolicy)
        assert (policy.window, policy.switch_cost, policy.switch_share) == (3, 0.2, 0.5)
    finally:
        asyncio.run(engine.aclose())
    data["routing"]["conversation"] = {"window": 0, "margin": 0.1}
    with pytest.raises(ConfigError) as info:
        parse_config(data, environ={})
    paths = [path for path, _ in info.value.problems]
    assert "routing.conversation.window" in paths and "routing.conversation.margin" in paths
    data = base()
    data["sessions"] = {"ttl": 0}
    with pytest.raises(ConfigError) as info:
        parse_config(data, environ={})
    assert [path for path, _ in info.value.problems] == ["sessions.ttl"]


def _unwrap(client: Any, kind: type[Any]) -> Any:
    """The first layer of `client` (following `.inner`) that is a `kind`."""
    while not isinstance(client, kind):
        client = client.inner
    return client


def _provider(client: Any, engine: Any = None) -> Any:
    """The provider (or the route's view of it) under a chain member's session layers."""
    return _unwrap(client, HistoryHygieneChatClient).inner


class _FirstRoute:
    """A routing policy in one class: every request goes to the first route."""

    def __init__(self, engine: Any, profile_index: Any) -> None:
        self.clients = tuple(engine.routes.values())
        self.default_client = self.clients[0]
        self.closed = False

    async def route(self, messages: Any) -> RouteDecision:
        first = self.clients[0]
        return RouteDecision(first, 1.0, {first: 1.0}, is_default=False, winner=first)

    async def route_batch(self, queries: Any) -> list[RouteDecision]:
        return [await self.route([]) for _ in queries]

    async def aclose(self) -> None:
        self.closed = True


def test_routing_policy_is_chosen_by_the_config_and_unknown_ones_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = base()
    data["routing"]["policy"] = "first"
    config = parse_config(data, environ={})
    with pytest.raises(ConfigError) as caught:
        build_engine(config, environ={}, embedder=_NoEmbedder())
    assert "routing.policy" in str(caught.value) and "semantic" in str(caught.value)

    monkeypatch.setitem(ROUTING_POLICIES, "first", _FirstRoute)
    engine = build_engine(config, environ={}, embedder=_NoEmbedder())
    try:
        assert isinstance(engine.router, _FirstRoute) and isinstance(engine.router, Router)
        decision = asyncio.run(engine.decide([ChatMessage("user", "fix this bug")]))
        assert engine.route_name(decision.client) == "code"
        assert engine.describe(decision)["route"] == "code"
    finally:
        asyncio.run(engine.aclose())
    assert parse_config(base(), environ={}).routing.policy == "semantic"


def test_thresholds_file_is_checked(tmp_path: Path) -> None:
    config = parse_config(base(), environ={})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"thresholds": {"code": 0.4, "nope": 0.1}}), encoding="utf-8")
    with pytest.raises(ConfigError, match="nope: unknown route"):
        load_thresholds(str(path), config)
    path.write_text(json.dumps({"thresholds": {"code": 0.4}}), encoding="utf-8")
    assert load_thresholds(str(path), config) == {"code": 0.4}
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(ConfigError, match="no 'thresholds' object"):
        load_thresholds(str(path), config)


class _NoEmbedder:
    """An embedding generator that is never asked for vectors in these tests."""

    fingerprint = None

    async def generate(self, values: Any) -> Any:
        raise AssertionError("not expected to embed")

    async def aclose(self) -> None:
        pass


# ------------------------------------------------------------------------- resilience


def test_resilience_defaults_and_route_overrides() -> None:
    data = base()
    data["resilience"] = {
        "deadline": 60,
        "max_attempts": 4,
        "retry_after_max": 3,
        "breaker": {"minimum_requests": 10, "cool_down": 5},
    }
    data["routes"]["code"].update(
        {
            "deadline": 20,
            "retry_same_provider": True,
            "retry_backoff": 0.5,
            "timeouts": {"first_token": 4, "stall": 8},
        }
    )
    config = parse_config(data, environ={})
    code = config.resilience.for_route(config.routes["code"])
    assert (code.deadline, code.max_attempts, code.retry_same_provider) == (20, 4, True)
    assert (code.retry_backoff, code.retry_after_max) == (0.5, 3)
    assert (code.first_token, code.stall, code.attempt) == (4, 8, None)
    general = config.resilience.for_route(config.routes["general"])
    assert (general.deadline, general.retry_same_provider, general.first_token) == (60, False, None)
    assert config.resilience.breaker.minimum_requests == 10


def test_attempt_timeout_also_accepts_its_older_name() -> None:
    data = base()
    data["providers"]["fast"]["timeouts"] = {"request": 12, "first_token": 3}
    timeouts = parse_config(data, environ={}).providers["fast"].timeouts
    assert timeouts.attempt == 12 and timeouts.request == 12 and timeouts.first_token == 3


def test_bad_resilience_settings_name_their_keys() -> None:
    data = base()
    data["resilience"] = {"deadline": 0, "breaker": {"failure_rate_threshold": 2}, "bogus": 1}
    data["routes"]["code"]["timeouts"] = {"first_token": -1}
    data["routes"]["code"]["max_tries_per_provider"] = 0
    found = problems(data)
    for key in (
        "resilience.deadline",
        "resilience.breaker.failure_rate_threshold",
        "resilience.bogus",
        "routes.code.timeouts.first_token",
        "routes.code.max_tries_per_provider",
    ):
        assert any(p.startswith(f"{key}:") for p in found), (key, found)


def test_engine_chains_share_one_breaker_per_provider_and_apply_route_limits() -> None:
    data = base()
    data["providers"]["strong"]["timeouts"] = {"first_token": 9}
    data["routes"]["code"]["timeouts"] = {"first_token": 2}
    data["routes"]["code"]["max_attempts"] = 2
    data["resilience"] = {"deadline": 30}
    config = parse_config(data, environ={})
    engine = build_engine(config, environ={}, embedder=_NoEmbedder())
    try:
        code, general = engine.chains["code"], engine.chains["general"]
        assert code.breakers["strong"] is general.breakers["strong"]
        assert code.breakers["strong"] is engine.breakers.get("strong")
        assert code.maximum_attempts_per_request == 2 and code.request_deadline == 30
        fast_view, strong_view = (_provider(c, engine) for c in code.clients)
        assert fast_view is not engine.providers["fast"]  # a view with the route's limit
        assert fast_view.first_token_timeout == 2
        assert strong_view.first_token_timeout == 2
        # the provider's own: 9 s
        assert _provider(general.clients[0], engine) is engine.providers["strong"]
        assert engine.providers["strong"].first_token_timeout == 9  # type: ignore[attr-defined]
        assert engine.resilience["code"].deadline == 30
    finally:
        asyncio.run(engine.aclose())


def test_given_providers_get_the_configured_limits_as_a_wrapper() -> None:
    from chatroute.failover.timeouts import TimeoutChatClient

    data = base()
    data["providers"]["strong"]["timeouts"] = {"first_token": 9, "stall": 4}
    config = parse_config(data, environ={})
    custom = _Unused()
    engine = build_engine(config, environ={}, embedder=_NoEmbedder(), providers={"strong": custom})
    try:
        member = engine.chains["general"].clients[0]
        wrapped = _provider(member, engine)
        assert isinstance(wrapped, TimeoutChatClient) and wrapped.inner is custom
        assert (wrapped.first_token_timeout, wrapped.stall_timeout) == (9, 4)
        assert engine.chains["general"].provider_name(member) == "strong"
    finally:
        asyncio.run(engine.aclose())


class _Unused(ChatClient):
    """A provider that is never called in these tests."""

    async def get_response(self, messages: Any, options: Any = None) -> Any:
        raise AssertionError("not expected to be called")

    def get_streaming_response(self, messages: Any, options: Any = None) -> Any:
        raise AssertionError("not expected to be called")


def test_header_values_that_could_split_the_request_head_are_refused_with_the_key() -> None:
    from chatroute.config import ConfigError, parse_config

    def config(**provider: Any) -> dict[str, Any]:
        return {
            "routing": {"default_route": "r"},
            "providers": {"p": {"base_url": "http://127.0.0.1:1/v1", "model": "m", **provider}},
            "routes": {"r": {"utterances": ["hi"], "targets": ["p"]}},
        }

    for headers in ({"x-team": "blue\r\nx-admin: yes"}, {"x-team": "a\nb"}, {"x\rbad": "v"}):
        with pytest.raises(
            ConfigError, match=r"providers\.p\.headers.*(line break or NUL|not a valid HTTP token)"
        ):
            parse_config(config(headers=headers), environ={})
    with pytest.raises(ConfigError, match=r"providers\.p\.api_key_env.*KEY holds CR, LF"):
        parse_config(config(api_key_env="KEY"), environ={"KEY": "sk-abc\r\nx-evil: 1"})
    parse_config(config(headers={"x-team": "blue"}, api_key_env="KEY"), environ={"KEY": "sk-1"})


def test_pass_through_and_cors_take_only_what_they_mean() -> None:
    data = base()
    data["providers"]["strong"]["pass_through"] = ["top_k"]
    data["server"] = {"cors": {"allow_origins": ["https://app.example"]}}
    config = parse_config(data, environ={})
    assert config.providers["strong"].pass_through == ["top_k"]
    assert config.providers["fast"].pass_through is None  # the provider type's default
    assert config.server.cors is not None and config.server.cors.allow_methods == ["GET", "POST"]
    assert parse_config(base(), environ={}).server.cors is None  # off by default
    data["providers"]["strong"]["pass_through"] = "some"
    data["server"] = {"cors": {}}
    found = problems(data)
    assert any(p.startswith("providers.strong.pass_through") for p in found), found
    assert any(p.startswith("server.cors.allow_origins") for p in found), found
    data = base()
    data["routes"]["code"]["overide"] = {"temperature": 0}
    assert any("did you mean 'override'" in p for p in problems(data))


@pytest.mark.parametrize(
    ("scoring", "expected"), [("top_k", 0.3), ("knn", 0.25), ("prototype", 0.2), ("adapter", 0.58)]
)
def test_unset_threshold_is_the_scoring_modes_own(scoring: str, expected: float) -> None:
    data = base()
    del data["routing"]["threshold"]
    data["routing"]["scoring"] = scoring
    routing = parse_config(data, environ={}).routing
    assert routing.threshold is None
    assert routing.score_threshold == expected
    # A threshold the config sets wins over the mode's default.
    data["routing"]["threshold"] = 0.42
    assert parse_config(data, environ={}).routing.score_threshold == 0.42


def test_the_engines_router_uses_the_modes_default_threshold() -> None:
    data = base()
    del data["routing"]["threshold"]
    config = parse_config(data, environ={})
    assert config.routing.scoring == "prototype"
    engine = build_engine(config, environ={}, embedder=_NoEmbedder())
    try:
        assert engine.router.score_threshold == pytest.approx(0.2)
    finally:
        asyncio.run(engine.aclose())
