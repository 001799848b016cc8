"""SemanticRoutingChatClient: picks the client whose example utterances are closest to the query."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from chatroute.chat.client import ChatClient
from chatroute.chat.embedding import EmbeddingFingerprint, EmbeddingGenerator
from chatroute.chat.types import ChatMessage, ChatRole
from chatroute.index import (
    Backend,
    FingerprintMismatchError,
    InvalidEmbeddingError,
    ProfileIndex,
    as_embedding_matrix,
    l2_normalize_rows,
)
from chatroute.router.base import RoutingChatClient, close_each_once
from chatroute.router.context import RoutingContext
from chatroute.router.conversation import ContextPolicy, LastUserPolicy, context_policy
from chatroute.router.decision import RouteDecision, RouteMatch, ScoreAggregation
from chatroute.router.learned import LearnedDecisions
from chatroute.router.route_scores import RouteGather, dense_route_scores
from chatroute.router.scoring import ScoringMode, TopKScoring, make_scoring

__all__ = ["SemanticRoutingChatClient"]

logger = logging.getLogger("chatroute.router")

# Searches or builds bigger than this many vector elements leave the event loop for a thread.
_OFFLOAD_ELEMENTS = 1 << 22


class SemanticRoutingChatClient(RoutingChatClient):
    """Routes each request by the cosine similarity of its last user message to profiles.

    `client_profiles` maps each client to example utterances. On the first request with a
    usable query, every utterance is embedded in one `generate` call and put in a profile
    index (built once, under a lock). Each request then embeds its query, takes the global
    top-`top_k` profile hits, aggregates them per client (`score_aggregation`) and selects
    the best client when its aggregate is at least its threshold, else `default_client`.

    Keyword-only extras, none of which changes the behaviour when left out:

    - `route_thresholds`: a per-client threshold (for example fitted by
      `chatroute.router.calibration`) that replaces `score_threshold` when that client
      wins. Keys must be `default_client` or profile keys (by identity); bounds as for
      `score_threshold`.
    - `profile_index`: a prebuilt `ProfileIndex` (for example `ProfileIndex.load`ed) whose
      rows are the flattened profile utterances in order; the profile batch call is then
      skipped.
    - `index_device` / `index_backend`: where the index searches. By default it follows
      the generator's `device` attribute when that is a CUDA device, else the CPU.
    - `scoring`: how routes are scored, a name from `SCORING_MODES` or a `ScoringMode`
      ("top_k", the rule above, by default; "knn"; "prototype"). With another mode than
      "top_k", every route is scored by the mode, the winner is the best route (scores
      within 1e-6 of the best count as a tie, won by the route listed first), its
      out-of-scope score is compared with its threshold, and `top_k` only sets how many
      nearest utterances a decision lists as `matches`. A mode that trains does so when
      the index is built (or when a given index carries no head for these profiles and
      settings), in a worker thread.
    - `context`: the context policy (`chatroute.router.conversation`) that decides which
      text a request's decision reads: "last_user" (the default: the rule above) or
      "conversation" (the turn in its conversation), or a `ContextPolicy` object.

    `aclose()` closes the clients and the generator unless `leave_open` is set.
    """

    def __init__(
        self,
        embedding_generator: EmbeddingGenerator,
        client_profiles: Mapping[ChatClient, Sequence[str]],
        default_client: ChatClient,
        *,
        score_threshold: float = 0.3,
        top_k: int = 1,
        score_aggregation: ScoreAggregation = ScoreAggregation.MEAN,
        leave_open: bool = False,
        route_thresholds: Mapping[ChatClient, float] | None = None,
        profile_index: ProfileIndex | None = None,
        index_device: str | None = None,
        index_backend: Backend = "auto",
        scoring: str | ScoringMode = "top_k",
        context: ContextPolicy | str | None = None,
    ) -> None:
        # SR1, in order.
        if embedding_generator is None:
            raise TypeError("embedding_generator must not be None")
        if client_profiles is None:
            raise TypeError("client_profiles must not be None")
        if default_client is None:
            raise TypeError("default_client must not be None")
        if not callable(getattr(embedding_generator, "generate", None)):
            raise TypeError("embedding_generator must be an EmbeddingGenerator")
        if not isinstance(client_profiles, Mapping):
            raise TypeError("client_profiles must be a mapping of client to utterances")
        if not isinstance(default_client, ChatClient):
            raise TypeError("default_client must be a ChatClient")
        if len(client_profiles) == 0:
            raise ValueError("client_profiles must contain at least one client")
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError("top_k must be an int")
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        if not isinstance(score_aggregation, ScoreAggregation):
            raise ValueError(
                f"score_aggregation must be a ScoreAggregation member, got {score_aggregation!r}"
            )
        mode = make_scoring(scoring)
        sums = isinstance(mode, TopKScoring) and score_aggregation is ScoreAggregation.SUM
        limit = float(top_k) if sums else 1.0
        threshold = _check_threshold(score_threshold, limit, "score_threshold")

        routes: list[ChatClient] = [default_client]
        route_of: dict[int, int] = {id(default_client): 0}
        pair_routes: list[int] = []
        utterances: list[str] = []
        for client, texts in list(client_profiles.items()):
            if client is None:
                raise ValueError("client_profiles has a None key")
            if not isinstance(client, ChatClient):
                raise TypeError(f"client_profiles keys must be ChatClients, got {client!r}")
            if texts is None or (isinstance(texts, str) and not texts):
                raise ValueError(f"the utterance list of {client!r} is None or empty")
            if isinstance(texts, str):
                raise TypeError(
                    f"the utterances of {client!r} must be a sequence of str, not a bare str"
                )
            items = list(texts)
            if not items:
                raise ValueError(f"the utterance list of {client!r} is empty")
            for text in items:
                if text is not None and not isinstance(text, str):
                    raise TypeError(
                        f"utterances must be str, got {type(text).__name__} for {client!r}"
                    )
            for text in items:
                if text is None or not text or text.isspace():
                    raise ValueError(
                        f"an utterance of {client!r} is None, empty or whitespace only"
                    )
            route = route_of.get(id(client))
            if route is None:
                route = len(routes)
                route_of[id(client)] = route
                routes.append(client)
            pair_routes.extend([route] * len(items))
            utterances.extend(items)

        self._generator = embedding_generator
        self._default = default_client
        self._routes: tuple[ChatClient, ...] = tuple(routes)
        self._route_of = route_of
        self._pair_routes: tuple[int, ...] = tuple(pair_routes)
        self._utterances: tuple[str, ...] = tuple(utterances)
        self._threshold = threshold
        self._limit = limit
        self._scoring = mode
        column_of: dict[int, int] = {}
        self._groups = np.asarray(
            [column_of.setdefault(route, len(column_of)) for route in pair_routes], dtype=np.int64
        )
        self._column_routes: tuple[int, ...] = tuple(column_of)
        self._state: Any = None
        self._ready: ProfileIndex | None = None
        self._top_k = top_k
        self._aggregation = score_aggregation
        self._leave_open = bool(leave_open)
        self._route_thresholds = self._check_route_thresholds(route_thresholds, limit)
        self._learned = LearnedDecisions(
            mode,
            self._routes,
            self._column_routes,
            self._pair_routes,
            self._utterances,
            threshold,
            self._route_thresholds,
            top_k,
        )
        self._index_device = _resolve_index_device(index_device, embedding_generator)
        self._index_backend: Backend = index_backend
        self._index: ProfileIndex | None = None
        if profile_index is not None:
            self._index = self._check_profile_index(profile_index)
        self._build_lock = asyncio.Lock()
        self._closed = False
        self._context = context_policy(context)
        # None: the last user message decides, on the path below that predates policies.
        self._policy = None if isinstance(self._context, LastUserPolicy) else self._context
        self._gather: RouteGather | None = None

    # -- configuration --------------------------------------------------------------------

    @property
    def embedding_generator(self) -> EmbeddingGenerator:
        """The generator that embeds profiles and queries."""
        return self._generator

    @property
    def default_client(self) -> ChatClient:
        """The fallback client (route 0)."""
        return self._default

    @property
    def score_threshold(self) -> float:
        """The inclusive threshold a winner's aggregate must reach (unless overridden)."""
        return self._threshold

    @property
    def top_k(self) -> int:
        """How many ranked profile hits form the global top-K."""
        return self._top_k

    @property
    def scoring(self) -> ScoringMode:
        """The scoring mode."""
        return self._scoring

    @property
    def score_limit(self) -> float:
        """The bound of scores and thresholds: `top_k` for top_k SUM aggregation, else 1."""
        return self._limit

    @property
    def training_seconds(self) -> float | None:
        """How long training the scoring head took (0 for modes that do not train).

        None until the index is ready; for a head reused from a saved index, the time it
        took when it was trained.
        """
        ready = self._ready
        if ready is None:
            return None
        seconds = ready.train_seconds
        return 0.0 if seconds is None else seconds

    @property
    def score_aggregation(self) -> ScoreAggregation:
        """How a client's hits inside the top-K are combined."""
        return self._aggregation

    @property
    def leave_open(self) -> bool:
        """Whether `aclose()` leaves the clients and the generator open."""
        return self._leave_open

    @property
    def route_thresholds(self) -> dict[ChatClient, float]:
        """The per-client thresholds that replace `score_threshold` (a new dict)."""
        return {self._routes[route]: value for route, value in self._route_thresholds.items()}

    @property
    def clients(self) -> tuple[ChatClient, ...]:
        """Every distinct route client: the default first, then profile keys in order."""
        return self._routes

    @property
    def profiles(self) -> tuple[tuple[ChatClient, str], ...]:
        """The flattened (client, utterance) pairs, in profile-index order."""
        return tuple(
            (self._routes[route], text)
            for route, text in zip(self._pair_routes, self._utterances, strict=True)
        )

    @property
    def context(self) -> ContextPolicy:
        """The context policy that decides which text a request's decision reads."""
        return self._context

    @property
    def profile_index(self) -> ProfileIndex | None:
        """The profile index, once built (or the one given at construction).

        Once the router is ready it is the index it searches, with the scoring head.
        """
        return self._ready if self._ready is not None else self._index

    async def prepare(self) -> ProfileIndex:
        """Build the profile index and train the scoring head now, not on first use."""
        return await self._ensure_index()

    def threshold_for(self, client: ChatClient) -> float:
        """The threshold applied when `client` wins."""
        route = self._route_of.get(id(client))
        if route is None:
            return self._threshold
        return self._route_thresholds.get(route, self._threshold)

    # -- routing --------------------------------------------------------------------------

    async def select_client(self, context: RoutingContext) -> ChatClient:
        if context is None:
            raise TypeError("context must not be None")
        return (await self.route(context.messages)).client

    async def route(self, messages: Sequence[ChatMessage]) -> RouteDecision:
        """The decision `select_client` would act on for `messages`; calls no chat client."""
        if messages is None:
            raise TypeError("messages must not be None")
        if self._policy is not None:
            return self._named((await self._policy.decide(self, [messages]))[0])
        query = _last_user_text(messages)
        if query is None or _is_blank(query):
            return self._fallback()
        index = await self._ensure_index()
        raw = await self._generator.generate([query])
        return (await self._decide(index, raw, 1))[0]

    async def route_embeddings(
        self, embeddings: Any, *, oos_score: str | None = None
    ) -> list[RouteDecision]:
        """One decision per query embedding row (made by the router's own model).

        `oos_score` gates on another of the mode's out-of-scope scores than its own (as
        `calibrate` does to compare them). Zero rows fall back to the default client.
        """
        if embeddings is None:
            raise TypeError("embeddings must not be None")
        if oos_score is not None:
            self._scoring._check_oos_score(oos_score)
        index = await self._ensure_index()
        rows = int(np.shape(embeddings)[0]) if np.ndim(embeddings) == 2 else -1
        if rows < 0:
            raise ValueError("embeddings must be a 2-D matrix, one row per query")
        return await self._decide(index, embeddings, rows, oos_score)

    async def route_batch(self, queries: Sequence[str]) -> list[RouteDecision]:
        """One decision per query, with one embedding call and one index search in all."""
        if queries is None:
            raise TypeError("queries must not be None")
        if isinstance(queries, str):
            raise TypeError("queries must be a sequence of str, not a bare str")
        items = list(queries)
        for position, item in enumerate(items):
            if not isinstance(item, str):
                raise TypeError(f"query {position} is {type(item).__name__}, not str")
        decisions: list[RouteDecision | None] = [None] * len(items)
        usable: list[int] = []
        for position, item in enumerate(items):
            if _is_blank(item):
                decisions[position] = self._fallback()
            else:
                usable.append(position)
        if usable:
            index = await self._ensure_index()
            raw = await self._generator.generate([items[position] for position in usable])
            for position, decision in zip(
                usable, await self._decide(index, raw, len(usable)), strict=True
            ):
                decisions[position] = decision
        return [decision for decision in decisions if decision is not None]

    async def route_conversations(
        self, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[RouteDecision]:
        """The decision for each conversation's last user turn under the context policy,
        with one embedding call in all (turns already scored come from its cache)."""
        if conversations is None:
            raise TypeError("conversations must not be None")
        items = list(conversations)
        for position, messages in enumerate(items):
            if isinstance(messages, str) or not all(isinstance(m, ChatMessage) for m in messages):
                raise TypeError(f"conversation {position} is not a sequence of ChatMessage")
        return [self._named(decision) for decision in await self._context.decide(self, items)]

    def _named(self, decision: RouteDecision) -> RouteDecision:
        """`decision` naming this router's scoring mode (a policy builds it from scores)."""
        name = self._scoring.name
        return decision if decision.scoring == name else dataclasses.replace(decision, scoring=name)

    async def score_routes(
        self, texts: Sequence[str]
    ) -> list[tuple[npt.NDArray[np.float32], tuple[RouteMatch, ...]]]:
        """Every route's score for each text, in `clients` order, and the text's top-K matches.

        A route's score is the scoring mode's (under "top_k": the aggregate of its own best
        `top_k` similarities; -inf for a route without utterances), so a context policy can
        weigh any two routes; the matches are those a single-message decision reports. One
        embedding call in all; a blank text or a zero-norm embedding gives -inf everywhere and
        no matches.
        """
        items = list(texts)
        routes = len(self._routes)
        out: list[tuple[npt.NDArray[np.float32], tuple[RouteMatch, ...]]] = [
            (np.full(routes, -np.inf, dtype=np.float32), ()) for _ in items
        ]
        usable = [position for position, text in enumerate(items) if not _is_blank(text)]
        if not usable:
            return out
        index = await self._ensure_index()
        raw = await self._generator.generate([items[position] for position in usable])
        matrix = as_embedding_matrix(
            raw, rows=len(usable), dimension=index.dimension, what="query", allow_zero_rows=True
        )
        normalized, norms = l2_normalize_rows(matrix)
        if isinstance(self._scoring, TopKScoring):
            if self._gather is None:
                self._gather = RouteGather(self._pair_routes, routes)
            dense = dense_route_scores(
                normalized @ index.vectors.T, self._gather, self._top_k, self._aggregation
            )
        else:  # the scoring mode's own route scores, its columns put in `clients` order
            dense = np.full((len(usable), routes), -np.inf, dtype=np.float32)
            dense[:, list(self._column_routes)] = self._scoring.route_scores(
                self._state, normalized
            )
        scores, ids = index.search(normalized, min(self._top_k, len(index)), normalized=True)
        for row, position in enumerate(usable):
            if norms[row] > 0.0:
                matches = self._decision(scores[row], ids[row]).matches
                out[position] = (dense[row], matches)
        return out

    # -- internals ------------------------------------------------------------------------

    async def _ensure_index(self) -> ProfileIndex:
        ready = self._ready
        if ready is not None:
            return ready
        async with self._build_lock:
            if self._ready is None:
                index = await self._build_index()
                mode = self._scoring
                if mode.trains:
                    index = await asyncio.to_thread(index.trained, mode, self._groups)
                if not isinstance(mode, TopKScoring):
                    self._state = mode.prepare(index, self._groups, len(self._column_routes))
                self._ready = index
            return self._ready

    async def _build_index(self) -> ProfileIndex:
        if self._index is not None:
            return self._index
        raw = await self._generator.generate(list(self._utterances))
        vectors = as_embedding_matrix(raw, rows=len(self._utterances), what="profile")
        fingerprint = _generator_fingerprint(self._generator)
        if fingerprint is not None and fingerprint.dimension != vectors.shape[1]:
            raise InvalidEmbeddingError(
                f"the generator's fingerprint says dimension {fingerprint.dimension}, "
                f"its profile embeddings have {vectors.shape[1]}"
            )
        if vectors.size >= _OFFLOAD_ELEMENTS:
            built = await asyncio.to_thread(self._new_index, vectors, fingerprint)
        else:
            built = self._new_index(vectors, fingerprint)
        self._index = built
        return built

    def _new_index(
        self, vectors: npt.NDArray[np.float32], fingerprint: EmbeddingFingerprint | None
    ) -> ProfileIndex:
        return ProfileIndex(
            vectors,
            utterances=self._utterances,
            fingerprint=fingerprint,
            device=self._index_device,
            backend=self._index_backend,
        )

    async def _decide(
        self, index: ProfileIndex, raw: Any, rows: int, oos_score: str | None = None
    ) -> list[RouteDecision]:
        matrix = as_embedding_matrix(
            raw, rows=rows, dimension=index.dimension, what="query", allow_zero_rows=True
        )
        normalized, norms = l2_normalize_rows(matrix)
        live = norms > 0.0
        if not live.any():
            return [self._fallback() for _ in range(rows)]
        k = min(self._top_k, len(index))
        offload = normalized.shape[0] * len(index) >= _OFFLOAD_ELEMENTS
        if isinstance(self._scoring, TopKScoring):
            if offload:
                scores, ids = await asyncio.to_thread(index.search, normalized, k, normalized=True)
            else:
                scores, ids = index.search(normalized, k, normalized=True)
            return [
                self._decision(scores[row], ids[row]) if live[row] else self._fallback()
                for row in range(rows)
            ]
        gate = oos_score or self._scoring.oos_score
        learned = self._learned
        if rows == 1:  # the latency path: the mode's one-query scoring (a live row, see above)
            if offload:
                return [
                    await asyncio.to_thread(learned.one, self._state, index, normalized, k, gate)
                ]
            return [learned.one(self._state, index, normalized, k, gate)]
        if offload:
            parts = await asyncio.to_thread(learned.score, self._state, index, normalized, k, gate)
        else:
            parts = learned.score(self._state, index, normalized, k, gate)
        return [
            learned.decision(parts, row) if live[row] else self._fallback() for row in range(rows)
        ]

    def _decision(
        self, scores: npt.NDArray[np.float32], ids: npt.NDArray[np.int64]
    ) -> RouteDecision:
        routes = self._routes
        matches: list[RouteMatch] = []
        hits: dict[int, list[float]] = {}
        for raw_score, raw_id in zip(scores.tolist(), ids.tolist(), strict=True):
            route = self._pair_routes[raw_id]
            matches.append(
                RouteMatch(
                    client=routes[route],
                    utterance=self._utterances[raw_id],
                    score=raw_score,
                    profile_index=raw_id,
                )
            )
            hits.setdefault(route, []).append(raw_score)
        aggregates = {route: self._aggregate(values) for route, values in hits.items()}
        best_route = -1
        best = -math.inf
        for route, value in aggregates.items():
            if value > best:
                best_route, best = route, value
        threshold = self._route_thresholds.get(best_route, self._threshold)
        passed = best >= threshold
        winner = routes[best_route]
        return RouteDecision(
            client=winner if passed else self._default,
            score=best,
            scores={routes[route]: value for route, value in aggregates.items()},
            matches=tuple(matches),
            is_default=not passed,
            winner=winner,
            threshold=threshold,
            scoring=self._scoring.name,
        )

    def _aggregate(self, values: list[float]) -> float:
        if self._aggregation is ScoreAggregation.MAX:
            return values[0]
        total = math.fsum(values)
        if self._aggregation is ScoreAggregation.SUM:
            return total
        return total / len(values)

    def _fallback(self) -> RouteDecision:
        return RouteDecision(client=self._default, scoring=self._scoring.name)

    def _check_route_thresholds(
        self, thresholds: Mapping[ChatClient, float] | None, limit: float
    ) -> dict[int, float]:
        if thresholds is None:
            return {}
        if not isinstance(thresholds, Mapping):
            raise TypeError("route_thresholds must be a mapping of client to threshold")
        checked: dict[int, float] = {}
        for client, value in thresholds.items():
            route = self._route_of.get(id(client))
            if route is None:
                raise ValueError(
                    f"route_thresholds names {client!r}, which is neither the default client "
                    "nor a profile key"
                )
            checked[route] = _check_threshold(value, limit, f"the threshold of {client!r}")
        return checked

    def _check_profile_index(self, index: ProfileIndex) -> ProfileIndex:
        if not isinstance(index, ProfileIndex):
            raise TypeError("profile_index must be a ProfileIndex")
        if len(index) != len(self._utterances):
            raise ValueError(
                f"profile_index has {len(index)} rows for {len(self._utterances)} utterances"
            )
        if index.utterances is not None and index.utterances != self._utterances:
            raise ValueError("profile_index rows are not the profile utterances in mapping order")
        fingerprint = _generator_fingerprint(self._generator)
        if (
            fingerprint is not None
            and index.fingerprint is not None
            and fingerprint != index.fingerprint
        ):
            raise FingerprintMismatchError(
                f"profile_index was built with {index.fingerprint.model!r}, "
                f"the embedding generator is {fingerprint.model!r}"
            )
        return index

    # -- closing --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close each distinct client once (default first), then the generator; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._leave_open:
            return
        await close_each_once([*self._routes, self._generator])


def _check_threshold(value: Any, limit: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    number = float(value)
    if math.isnan(number) or math.isinf(number) or not -limit <= number <= limit:
        raise ValueError(f"{name} must be a finite number in [-{limit:g}, {limit:g}], got {value}")
    return number


def _last_user_text(messages: Iterable[ChatMessage]) -> str | None:
    last: ChatMessage | None = None
    for message in messages:
        if message.role == ChatRole.USER:
            last = message
    return None if last is None else last.text


def _is_blank(text: str) -> bool:
    return not text or text.isspace()


def _generator_fingerprint(generator: EmbeddingGenerator) -> EmbeddingFingerprint | None:
    fingerprint = getattr(generator, "fingerprint", None)
    return fingerprint if isinstance(fingerprint, EmbeddingFingerprint) else None


def _resolve_index_device(device: str | None, generator: EmbeddingGenerator) -> str | None:
    if device is not None:
        return str(device)
    found = getattr(generator, "device", None)
    if found is not None and str(found).startswith("cuda"):
        return str(found)
    return None
