"""The service configuration: a YAML file validated at start-up, errors naming the key at fault."""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from chatroute._config_conversation import ConversationConfig, SessionsConfig
from chatroute._config_values import did_you_mean, header_problem, key_hint, url_problem
from chatroute.chat.types import ChatOptions

__all__ = [
    "BreakerConfig",
    "ChatrouteConfig",
    "ConfigError",
    "ConversationConfig",
    "CorsConfig",
    "EmbedderConfig",
    "ProviderConfig",
    "ProviderTimeouts",
    "ResilienceConfig",
    "RouteConfig",
    "RouteOptions",
    "RouteResilience",
    "RouteTimeouts",
    "RoutingConfig",
    "ServerConfig",
    "SessionsConfig",
    "load_config",
    "parse_config",
]

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
Name = Annotated[str, StringConstraints(pattern=_NAME_PATTERN)]
EnvName = Annotated[str, StringConstraints(pattern=_ENV_PATTERN)]


def _not_blank(text: str) -> str:
    if not text or text.isspace():
        raise ValueError("must not be empty or whitespace")
    return text


Utterance = Annotated[str, AfterValidator(_not_blank)]


def _thread_count_or_all(value: Any) -> Any:
    if value == "all" or (type(value) is int and value >= 1):
        return value
    raise ValueError(f"'all' or a number of threads (1 or more), got {value!r}")


ThreadsOrAll = Annotated[Literal["all"] | int, BeforeValidator(_thread_count_or_all)]
PositiveSeconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
RESERVED_MODEL_NAMES = frozenset({"auto"})

# The time limits every provider and request gets unless the config says otherwise
# (`null` in the config switches a limit off). See ProviderTimeouts and ResilienceConfig.
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_FIRST_TOKEN_TIMEOUT = 120.0
DEFAULT_STALL_TIMEOUT = 60.0
DEFAULT_REQUEST_DEADLINE = 600.0


class ConfigError(ValueError):
    """The configuration is invalid; `problems` lists (key path, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  {path or '<root>'}: {message}" for path, message in problems)
        super().__init__(f"invalid chatroute config{where}:\n{lines}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CorsConfig(_Strict):
    """Cross-origin access for browser callers (Starlette's CORSMiddleware); the keys are
    its arguments. `allow_origins` lists the origins (`"*"`: any) whose pages may call
    the API; `expose_headers` the answer headers their scripts may read."""

    allow_origins: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    allow_origin_regex: str | None = None
    allow_methods: list[str] = ["GET", "POST"]
    allow_headers: list[str] = ["*"]
    allow_credentials: bool = False
    expose_headers: list[str] = [
        "x-chatroute-route",
        "x-chatroute-provider",
        "x-chatroute-attempts",
        "x-chatroute-upstream-request-id",
        "x-chatroute-ignored-params",
        "x-chatroute-overridden",
        "retry-after",
    ]
    max_age: int = Field(default=600, ge=0)


class ServerConfig(_Strict):
    """Where the service listens and the limits it enforces on requests.

    `max_body_bytes`, `max_messages`, `max_message_chars` (per message), `max_json_depth`
    and `max_classify_inputs` bound a request; `body_timeout` is how long a body may take
    to arrive, and `head_timeout` how long a request head may take once it has begun
    (a caller that takes longer has its connection closed). `gc_freeze` moves everything
    loaded at start-up (model, index) out of the garbage collector's reach, so full
    collections do not stall requests. `gc_threshold` is how many allocations the cyclic
    garbage collector lets pass between collections of its youngest generation while the
    service runs (Python's default, 700, means a collection every request or two on the
    chat path); None leaves Python's setting.
    `forwarded_allow_ips` lists the proxies (addresses or networks, `"*"` for any) whose
    `X-Forwarded-For` / `X-Forwarded-Proto` headers are believed; unset, they are ignored
    and each request costs one middleware less. `cors` answers browsers' cross-origin
    requests (`CorsConfig`); unset (the default), no cross-origin access is granted.
    `admin_key_env` names the variable that holds the admin key of `POST /admin/reload`
    (unset or empty: no admin API).
    `log_format` is how `chatroute serve` writes its log: `text` lines, or `json`, one
    JSON object per line (the request log line's fields as keys).
    """

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys_env: EnvName = "CHATROUTE_API_KEYS"
    admin_key_env: EnvName = "CHATROUTE_ADMIN_KEY"
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    max_messages: int = Field(default=1024, ge=1)
    max_message_chars: int = Field(default=1_000_000, ge=1)
    max_json_depth: int = Field(default=64, ge=4, le=512)
    max_classify_inputs: int = Field(default=2048, ge=1)
    body_timeout: PositiveSeconds = 30.0
    head_timeout: PositiveSeconds = 10.0
    gc_freeze: bool = True
    gc_threshold: int | None = Field(default=20_000, ge=100)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_format: Literal["text", "json"] = "text"
    forwarded_allow_ips: list[Annotated[str, Field(min_length=1)]] | None = None
    cors: CorsConfig | None = None


class EmbedderConfig(_Strict):
    """The local sentence-transformer that embeds queries and route utterances."""

    model: str = Field(default="default", min_length=1)
    device: str = Field(default="auto", min_length=1)
    dtype: Literal["auto", "fp32", "fp16", "bf16", "float32", "float16", "bfloat16"] = "auto"
    max_batch_size: int | None = Field(default=None, ge=1)
    max_batch_tokens: int | None = Field(default=None, ge=1)
    max_queue: int | None = Field(default=None, ge=1)
    tokenizer_threads: int | None = Field(default=None, ge=1)
    workers: int | None = Field(default=None, ge=1)
    batch_wait_ms: float | None = Field(default=None, ge=0, le=1000)
    pack_width: int | None = Field(default=None, ge=0, le=1024)
    solo_threads: ThreadsOrAll = "all"


class RoutingConfig(_Strict):
    """How requests are routed: the policy (`semantic`: by similarity to each route's
    utterances), how it scores routes, and where unmatched requests go.

    `scoring` picks the scoring mode: "prototype" (one learned vector per route, trained
    when the profile index is built), "adapter" (a learned linear map of the embeddings
    and one centroid per route in its space, also trained then), "knn" (a
    softmax-weighted vote of every utterance) or "top_k" (the global top-K hits
    aggregated by `aggregation`). `oos_score` is the
    score a winner's threshold is compared with (None: the mode's default; `chatroute
    fit` reports the one that fits best). With a mode other than "top_k", `top_k` only
    sets how many nearest utterances an answer lists. `context` picks what a decision
    reads: "conversation" (the last user turn in its conversation, tuned by
    `conversation`) or "last_user" (the last user message alone).
    """

    policy: Name = "semantic"
    context: Literal["conversation", "last_user"] = "conversation"
    conversation: ConversationConfig = ConversationConfig()
    scoring: Literal["prototype", "knn", "top_k", "adapter"] = "prototype"
    oos_score: Literal["blend", "centroid", "prototype", "nearest", "route", "aggregate"] | None = (
        None
    )
    top_k: int = Field(default=5, ge=1)
    aggregation: Literal["mean", "sum", "max"] = "mean"
    threshold: float | None = Field(default=None, allow_inf_nan=False)
    default_route: Name
    thresholds_file: str | None = None
    index_path: str | None = None

    @property
    def score_threshold(self) -> float:
        """`threshold`, or the scoring mode's own default when the config sets none."""
        if self.threshold is not None:
            return self.threshold
        from chatroute.router.scoring import SCORING_MODES

        return SCORING_MODES[self.scoring].default_threshold


class ProviderTimeouts(_Strict):
    """Time limits of one provider attempt, in seconds (None: no limit).

    `attempt` bounds a whole attempt (a non-streamed answer, or a whole stream); it is
    also accepted under its older name `request`. `first_token` bounds the wait for the
    first content-bearing event of a stream (connecting included), or for a non-streamed
    answer's response head; `stall` the silence between two chunks once a stream has
    started. `connect`, `read`, `write` and `pool` are the HTTP transport's limits:
    `connect` (TCP and TLS), `read` (the longest wait for the next bytes of an answer),
    `write` (sending a request the upstream is slow to take in) and `pool` (waiting for a
    free connection when all are in use).

    The defaults never hang and leave room for reasoning models: a model that thinks
    without streaming its reasoning may be silent for a minute or two before its first
    token (`first_token` 120 s), while a stream that has started and then goes quiet for
    a minute has stalled (`stall` 60 s). `connect` 10 s covers a TLS handshake across
    continents with room to spare; a refused connection fails at once anyway.
    """

    connect: PositiveSeconds = DEFAULT_CONNECT_TIMEOUT
    read: PositiveSeconds = 300.0
    write: PositiveSeconds = 30.0
    pool: PositiveSeconds = 10.0
    attempt: PositiveSeconds | None = Field(
        default=None, validation_alias=AliasChoices("attempt", "request")
    )
    first_token: PositiveSeconds | None = DEFAULT_FIRST_TOKEN_TIMEOUT
    stall: PositiveSeconds | None = DEFAULT_STALL_TIMEOUT

    @property
    def request(self) -> float | None:
        """The older name of `attempt`."""
        return self.attempt


class RouteTimeouts(_Strict):
    """Per-route overrides of the providers' attempt limits (None: keep the provider's)."""

    attempt: PositiveSeconds | None = None
    first_token: PositiveSeconds | None = None
    stall: PositiveSeconds | None = None


class BreakerConfig(_Strict):
    """The circuit breaker every provider gets (shared by all routes that use it).

    It opens when, within the last `window` seconds, at least `minimum_requests` attempts
    were recorded and the share of failures reached `failure_rate_threshold`; after
    `cool_down` seconds it lets one probe through, which closes it on success.
    """

    failure_rate_threshold: float = Field(default=0.5, gt=0, le=1, allow_inf_nan=False)
    minimum_requests: int = Field(default=5, ge=1)
    window: PositiveSeconds = 30.0
    cool_down: PositiveSeconds = 15.0


class SharedStateConfig(_Strict):
    """State shared by the replicas of a service, through Redis (the `redis` extra).

    `redis_url_env` names the environment variable holding the Redis URL (it may carry a
    password, so it is never written in the file); when the variable is unset or empty
    the replica keeps its state to itself. Shared: circuit breakers (a provider that
    fails on one replica is avoided by all for the rest of the cool-down) and sticky
    sessions (`sessions`: a conversation keeps its provider on any replica). `key_prefix`
    starts every key and channel name, so several services can share one Redis.
    """

    redis_url_env: EnvName | None = None
    key_prefix: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = "chatroute"

    def redis_url(self, environ: Mapping[str, str]) -> str | None:
        """The Redis URL from the environment, or None when sharing is off."""
        if self.redis_url_env is None:
            return None
        return environ.get(self.redis_url_env) or None


@dataclass(frozen=True)
class RouteResilience:
    """The failover settings in force for one route (its own keys over `resilience`)."""

    deadline: float | None
    max_attempts: int | None
    retry_same_provider: bool
    max_tries_per_provider: int
    retry_backoff: float
    retry_after_max: float
    first_token: float | None = None
    stall: float | None = None
    attempt: float | None = None


class ResilienceConfig(_Strict):
    """Service-wide failover defaults (each route may override them) and breaker settings.

    - `deadline`: seconds a whole request may take, failovers and the streamed body
      included; the caller then gets 504 (or an in-band error once a stream started).
      None: no overall limit. The default, 10 minutes, is the openai SDK's own default
      timeout: room for a long reasoning answer, yet no request is held forever.
    - `max_attempts`: the attempt budget of one request, retries and fallbacks together.
      None: each target once (or `max_tries_per_provider` times when retrying).
    - `retry_same_provider`: a provider that failed with a retryable error (5xx, reset,
      429, malformed stream, ...) may be tried again in the same request, up to
      `max_tries_per_provider` times, `retry_backoff` seconds apart. A provider that timed
      out waiting for the first token or rejected the key is never retried in a request.
    - `retry_after_max`: the longest Retry-After (429) hint honoured by waiting for it; a
      longer one, or one that does not fit the deadline, fails over at once.
    - `caller_deadline`: honour an `x-chatroute-timeout: <seconds>` request header, which
      can only shorten the deadline.
    - `breaker`: the circuit breaker each provider gets, shared by every route.
    """

    deadline: PositiveSeconds | None = DEFAULT_REQUEST_DEADLINE
    max_attempts: int | None = Field(default=None, ge=1)
    retry_same_provider: bool = False
    max_tries_per_provider: int = Field(default=2, ge=1, le=10)
    retry_backoff: float = Field(default=0.0, ge=0, le=60, allow_inf_nan=False)
    retry_after_max: float = Field(default=5.0, ge=0, le=600, allow_inf_nan=False)
    caller_deadline: bool = True
    breaker: BreakerConfig = BreakerConfig()

    def for_route(self, route: RouteConfig) -> RouteResilience:
        """The settings in force for `route`: its own keys over these defaults."""

        def pick(own: Any, default: Any) -> Any:
            return own if own is not None else default

        return RouteResilience(
            deadline=pick(route.deadline, self.deadline),
            max_attempts=pick(route.max_attempts, self.max_attempts),
            retry_same_provider=pick(route.retry_same_provider, self.retry_same_provider),
            max_tries_per_provider=pick(route.max_tries_per_provider, self.max_tries_per_provider),
            retry_backoff=pick(route.retry_backoff, self.retry_backoff),
            retry_after_max=pick(route.retry_after_max, self.retry_after_max),
            first_token=route.timeouts.first_token,
            stall=route.timeouts.stall,
            attempt=route.timeouts.attempt,
        )


# Characters that would end a header line (or the request head) where they appear.
_SPLITS_HEAD = re.compile(r"[\r\n\0]")


class ProviderConfig(_Strict):
    """One upstream model endpoint; secrets come only from the environment.

    `type`: a registered provider type (`chatroute.providers.registry`): `openai` (any
    OpenAI-compatible chat-completions API; `base_url` required) or `anthropic`
    (Anthropic's Messages API; `base_url` defaults to Anthropic's), or one registered
    with `register_provider`. `default_max_tokens` is the output limit sent to an
    `anthropic` provider when a request sets none (its API requires one). `query` holds
    parameters every call carries in its URL (Azure OpenAI's `api-version`), and
    `api_key_header: api-key` sends the key as Azure's `api-key` header rather than
    `Authorization: Bearer` (openai providers). `pass_through`: which request fields
    chatroute does not know are forwarded ("all", "none" or a list of names; unset: "all"
    for openai, "none" for anthropic); `extra_body` wins over the caller's fields. Header
    names and values may not hold CR, LF or NUL.
    """

    type: str = "openai"
    base_url: str | None = None
    base_url_env: EnvName | None = None
    model: str | None = None
    model_env: EnvName | None = None
    api_key_env: EnvName | None = None
    timeouts: ProviderTimeouts = ProviderTimeouts()
    max_connections: int = Field(default=100, ge=1)
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    default_max_tokens: int = Field(default=4096, ge=1)
    context_window: int | None = Field(default=None, ge=1)
    headers: dict[str, str] = Field(default_factory=dict)
    query: dict[str, str] = Field(default_factory=dict)
    api_key_header: Literal["authorization", "api-key"] = "authorization"
    extra_body: dict[str, Any] = Field(default_factory=dict)
    pass_through: Literal["all", "none"] | list[Annotated[str, Field(min_length=1)]] | None = None

    @field_validator("query")
    @classmethod
    def _no_secret_query(cls, query: dict[str, str]) -> dict[str, str]:
        for key in query:
            if key.lower().replace("-", "_") in {"api_key", "key", "token", "access_token"}:
                raise ValueError(f"query parameter {key!r} carries a secret: use api_key_env")
        return query

    @field_validator("type")
    @classmethod
    def _registered_type(cls, value: str) -> str:
        from chatroute.providers.registry import provider_types

        known = provider_types()
        if value not in known:
            raise ValueError(
                f"unknown provider type {value!r}{did_you_mean(value, known)}; "
                f"known: {', '.join(known)}"
            )
        return value

    @field_validator("headers")
    @classmethod
    def _no_secret_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for key, value in headers.items():
            if key.lower() in {"authorization", "api-key", "x-api-key", "proxy-authorization"}:
                raise ValueError(f"header {key!r} carries a secret: use api_key_env instead")
            problem = header_problem(key, value)
            if problem:
                raise ValueError(problem)
        return headers

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        problem = None if url is None else url_problem(url)
        if problem:
            raise ValueError(problem)
        return url

    def resolved_base_url(self, environ: Mapping[str, str]) -> str | None:
        """The base URL: the named environment variable when set, else `base_url`."""
        if self.base_url_env and environ.get(self.base_url_env):
            return environ[self.base_url_env]
        return self.base_url

    def resolved_model(self, environ: Mapping[str, str]) -> str | None:
        """The model name: the named environment variable when set, else `model`."""
        if self.model_env and environ.get(self.model_env):
            return environ[self.model_env]
        return self.model


class RouteOptions(_Strict):
    """Chat options of a route: as `options`, defaults the caller's request overrides; as
    `override`, values forced whatever the caller sent (see `chatroute.precedence`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    max_output_tokens: int | None = Field(default=None, ge=1, alias="max_tokens")
    stop_sequences: list[str] | None = Field(default=None, alias="stop")
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    instructions: str | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None

    def apply(self, options: ChatOptions) -> None:
        """Fill in on `options` (a clone owned by the route) what the caller left unset."""
        from chatroute.precedence import fill_defaults

        fill_defaults(self, options)

    def is_empty(self) -> bool:
        """True when the route sets nothing (asked per request: nothing given, the usual
        case, is answered without dumping the model)."""
        return not self.model_fields_set or not self.model_dump(exclude_none=True)


class RouteConfig(_Strict):
    """A route: example utterances that select it, and the providers tried in order.

    `max_attempts`, `deadline`, `retry_same_provider`, `max_tries_per_provider`,
    `retry_backoff` and `retry_after_max` override the `resilience` defaults for this
    route; `timeouts` overrides its providers' attempt, first-token and stall limits.
    `options` are defaults for the request options the caller leaves unset; `override`
    forces its values whatever the caller sent.
    """

    description: str | None = None
    utterances: list[Utterance] = Field(default_factory=list)
    targets: list[Name] = Field(min_length=1)
    options: RouteOptions = RouteOptions()
    override: RouteOptions = RouteOptions()
    max_attempts: int | None = Field(default=None, ge=1)
    deadline: PositiveSeconds | None = None
    retry_same_provider: bool | None = None
    max_tries_per_provider: int | None = Field(default=None, ge=1, le=10)
    retry_backoff: float | None = Field(default=None, ge=0, le=60, allow_inf_nan=False)
    retry_after_max: float | None = Field(default=None, ge=0, le=600, allow_inf_nan=False)
    timeouts: RouteTimeouts = RouteTimeouts()


class ChatrouteConfig(_Strict):
    """The whole file: server, embedder, routing, providers and routes."""

    server: ServerConfig = ServerConfig()
    embedder: EmbedderConfig = EmbedderConfig()
    routing: RoutingConfig
    resilience: ResilienceConfig = ResilienceConfig()
    shared_state: SharedStateConfig = SharedStateConfig()
    sessions: SessionsConfig = SessionsConfig()
    providers: dict[Name, ProviderConfig] = Field(min_length=1)
    routes: dict[Name, RouteConfig] = Field(min_length=1)

    def check(self, environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
        """Cross-reference checks pydantic cannot express; returns (path, message) pairs."""
        env = os.environ if environ is None else environ
        problems: list[tuple[str, str]] = []
        for name, route in self.routes.items():
            if name in RESERVED_MODEL_NAMES:
                problems.append((f"routes.{name}", f"{name!r} is reserved for semantic routing"))
            for position, target in enumerate(route.targets):
                if target not in self.providers:
                    hint = did_you_mean(target, self.providers)
                    problems.append(
                        (
                            f"routes.{name}.targets[{position}]",
                            f"unknown provider {target!r}{hint}",
                        )
                    )
        default = self.routing.default_route
        if default not in self.routes:
            problems.append(
                (
                    "routing.default_route",
                    f"unknown route {default!r}{did_you_mean(default, self.routes)}",
                )
            )
        if not any(route.utterances for route in self.routes.values()):
            problems.append(("routes", "at least one route needs utterances"))
        routing = self.routing
        sums = routing.aggregation == "sum" and routing.scoring == "top_k"
        limit = routing.top_k if sums else 1
        if routing.oos_score is not None:
            from chatroute.router.scoring import SCORING_MODES

            offered = SCORING_MODES[routing.scoring].oos_scores
            if routing.oos_score not in offered:
                problems.append(
                    (
                        "routing.oos_score",
                        f"the {routing.scoring!r} scoring mode has no out-of-scope score "
                        f"{routing.oos_score!r}; use one of {', '.join(offered)}",
                    )
                )
        threshold = routing.score_threshold
        if not -limit <= threshold <= limit or math.isnan(threshold):
            problems.append(
                (
                    "routing.threshold",
                    f"must lie in [-{limit}, {limit}] for {self.routing.aggregation} aggregation"
                    if routing.scoring == "top_k"
                    else f"must lie in [-1, 1] for the {routing.scoring!r} scoring mode "
                    "(sum aggregation applies to 'top_k' scoring only)",
                )
            )
        redis_url = self.shared_state.redis_url(env)
        redis_problem = redis_url and url_problem(redis_url, ("redis", "rediss", "unix"))
        if redis_problem:
            problems.append(
                (
                    "shared_state.redis_url_env",
                    f"{self.shared_state.redis_url_env} in the environment: {redis_problem}",
                )
            )
        if self.shared_state.redis_url_env and importlib.util.find_spec("redis") is None:
            problems.append(
                (
                    "shared_state.redis_url_env",
                    'sharing state needs the redis client: pip install "chatroute[redis]"',
                )
            )
        for name, provider in self.providers.items():
            if provider.type == "anthropic" and provider.api_key_header != "authorization":
                problems.append(
                    (
                        f"providers.{name}.api_key_header",
                        "applies to openai providers only (anthropic sends x-api-key)",
                    )
                )
            if provider.api_key_env and _SPLITS_HEAD.search(env.get(provider.api_key_env, "")):
                problems.append(
                    (
                        f"providers.{name}.api_key_env",
                        f"{provider.api_key_env} holds CR, LF or NUL: it cannot go in a header",
                    )
                )
            if provider.base_url_env and env.get(provider.base_url_env):
                problem = url_problem(env[provider.base_url_env])
                if problem:
                    problems.append(
                        (
                            f"providers.{name}.base_url_env",
                            f"{provider.base_url_env} in the environment: {problem}",
                        )
                    )
            if provider.resolved_base_url(env) is None and _needs_base_url(provider.type):
                problems.append(
                    (f"providers.{name}.base_url", "required (or set base_url_env in the env)")
                )
            if provider.resolved_model(env) is None:
                problems.append(
                    (f"providers.{name}.model", "required (or set model_env in the env)")
                )
        return problems


def _needs_base_url(provider_type: str) -> bool:
    """Whether providers of this type need a configured base URL (no vendor default)."""
    from chatroute.providers.registry import provider_class

    return provider_class(provider_type).default_base_url is None


def _format_loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", part):
            path += f".{part}" if path else part
        else:
            path += f"[{part!r}]"
    return path


def _pydantic_problems(error: ValidationError) -> list[tuple[str, str]]:
    problems = []
    for item in error.errors(include_url=False):
        loc = tuple(p for p in item["loc"] if p != "[key]")
        message = item["msg"]
        if item["type"] == "extra_forbidden":
            message = "unknown key" + key_hint(ChatrouteConfig, loc)
        elif item["type"] == "literal_error" and isinstance(item.get("input"), str):
            choices = re.findall(r"'([^']*)'", str(item.get("ctx", {}).get("expected", "")))
            message += did_you_mean(item["input"], choices)
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        problems.append((_format_loc(loc), message))
    return problems


def parse_config(
    data: object, *, source: str | None = None, environ: Mapping[str, str] | None = None
) -> ChatrouteConfig:
    """Validate an already-parsed mapping; raises `ConfigError` naming every key at fault."""
    if not isinstance(data, Mapping):
        raise ConfigError([("", "the config must be a mapping")], source)
    try:
        config = ChatrouteConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_problems(exc), source) from None
    problems = config.check(environ)
    if problems:
        raise ConfigError(problems, source)
    return config


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> ChatrouteConfig:
    """Read and validate a YAML config file; raises `ConfigError` (a ValueError)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("", f"cannot read the file: {exc.strerror or exc}")], str(file))
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([("", f"not valid YAML{where}: {problem}")], str(file)) from None
    config = parse_config(data, source=str(file), environ=environ)
    return _resolve_relative_paths(config, file.parent)


def _resolve_relative_paths(config: ChatrouteConfig, base: Path) -> ChatrouteConfig:
    routing = config.routing
    updates: dict[str, str] = {}
    for key in ("thresholds_file", "index_path"):
        value = getattr(routing, key)
        if value is not None and not Path(value).is_absolute():
            updates[key] = str(base / value)
    if not updates:
        return config
    return config.model_copy(update={"routing": routing.model_copy(update=updates)})
