"""Context policies: which text a routing decision reads, and how the conversation weighs in."""

from __future__ import annotations

import hashlib
import math
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from chatroute.chat.client import ChatClient
from chatroute.chat.types import ChatMessage, ChatRole
from chatroute.router.decision import RouteDecision, RouteMatch

__all__ = [
    "ContextPolicy",
    "ConversationDecision",
    "ConversationPolicy",
    "LastUserPolicy",
    "RouteScorer",
    "TurnOutcome",
    "context_policy",
]

TurnOutcome = Literal["new", "kept", "switched"]

# One turn's scores: (routes,) float32, and the turn's global top-K matches.
TurnScores = tuple[npt.NDArray[np.float32], tuple[RouteMatch, ...]]


@runtime_checkable
class RouteScorer(Protocol):
    """What a context policy needs of a router (`SemanticRoutingChatClient` is one).

    `ConversationPolicy` also reads two optional attributes when a router has them:
    `scoring` (its mode's `name` picks the default temperature) and `score_limit` (the
    scale of its scores, `top_k` under top-K sum aggregation).
    """

    @property
    def clients(self) -> tuple[ChatClient, ...]:
        """Every route client, the default first: the columns of `score_routes`."""

    @property
    def default_client(self) -> ChatClient:
        """The fallback client."""

    def threshold_for(self, client: ChatClient) -> float:
        """The threshold a winning `client` must reach."""

    async def route_batch(self, queries: Sequence[str]) -> list[RouteDecision]:
        """One single-message decision per query, in one embedding call."""

    async def score_routes(self, texts: Sequence[str]) -> list[TurnScores]:
        """Every route's score for each text (one embedding call), with its top-K matches."""


@runtime_checkable
class ContextPolicy(Protocol):
    """Decides the last user turn of each conversation, reading what the policy chooses."""

    @property
    def name(self) -> str:
        """The policy's config name ("last_user", "conversation")."""

    async def decide(
        self, router: RouteScorer, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[RouteDecision]:
        """One decision per conversation, with at most one embedding call in all."""


@dataclass(frozen=True)
class ConversationDecision(RouteDecision):
    """A decision made in a conversation's context.

    Besides the `RouteDecision` fields (`score` is the chosen route's score on the last
    turn, `winner` that turn's best route, `scores` every route's score on it):

    - `outcome`: "new" when the conversation had no route before this turn (its first
      turn, or no earlier turn reached a threshold), "kept" when the decision stayed on
      the conversation's route, "switched" when it moved to another one (the route that
      clearly took this turn over, or an earlier route the turns now favour again).
    - `conversation_client` / `conversation_score`: the route the conversation was on
      before this turn (None when "new") and its score on this turn.
    - `challenger_client` / `challenger_score`: the best route other than the
      conversation's on this turn (None when there is none), where a switch usually goes.
    - `turns_read`: how many user turns the decision read.
    """

    outcome: TurnOutcome = "new"
    conversation_client: ChatClient | None = None
    conversation_score: float | None = None
    challenger_client: ChatClient | None = None
    challenger_score: float | None = None
    turns_read: int = 0


class LastUserPolicy:
    """Today's rule: the last user message alone decides (the library's default)."""

    name = "last_user"

    async def decide(
        self, router: RouteScorer, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[RouteDecision]:
        queries = [_last_user_text(messages) or "" for messages in conversations]
        return await router.route_batch(queries)

    def __repr__(self) -> str:
        return "LastUserPolicy()"


# Per scoring mode: the temperature of the share a turn gives each route (see
# `ConversationPolicy`). The scoring modes spread a turn's route scores differently
# (prototype scores spread about a third wider than top-K's), so each mode has its own,
# chosen on the same multi-turn dev set as the other parameters.
DEFAULT_TEMPERATURES: dict[str, float] = {"top_k": 0.085, "prototype": 0.12, "knn": 0.075}
FALLBACK_TEMPERATURE = 0.085  # a router that does not name a known scoring mode


class ConversationPolicy:
    """Routes a user turn by what it says in its conversation (the service's default).

    What is read: each of the last `window` user turns, followed by the last
    `assistant_chars` characters of the assistant text just before it (so a long answer
    can neither crowd the user's words out of the model's input nor make the decision
    cost much more than a single message's). Each such text is scored against every
    route (`score_routes`); a turn's *evidence* for a route is that score plus
    `match_weight` times the route's share of the turn's nearest example utterances (the
    sum of its matches' similarities over the number of matches), which steadies the
    learned scoring modes on short replies.

    How the conversation weighs in: the turns are replayed in order as a best path over
    routes. The first turn whose best route reaches its threshold opens the conversation
    on that route (the single-message decision); each later turn adds its evidence to
    every route's path, and a path may move to another route at a turn only when that
    route takes at least `switch_share` of the turn's evidence (`softmax(evidence /
    temperature)`), and only by paying `switch_cost`. The last turn's decision is the
    best path's route, so a follow-up that says little keeps the conversation where it
    is, a clear request for another route moves it, and a wrong move on a vague turn is
    undone when the next turns favour the old route again. Older turns are not read: the
    work per request is bounded by `window`.

    `temperature` None takes the scoring mode's default (`DEFAULT_TEMPERATURES`). Under
    top-K `sum` aggregation, whose scores grow with `top_k`, `switch_cost`, `temperature`
    and the matches' weight are scaled by the router's `score_limit`.

    Each turn's evidence depends on its own text only, so it is kept in an LRU cache of
    `cache_size` turns per router, keyed by a hash of the text: a request embeds only the
    turns not seen before (usually just the new one), all conversations of a batch in one
    embedding call. Decisions depend on the messages alone, so every replica decides a
    conversation the same way. The defaults were chosen on a multi-turn dev set with the
    default model (see docs/conversations.md).
    """

    name = "conversation"

    def __init__(
        self,
        *,
        window: int = 6,
        switch_cost: float = 0.26,
        switch_share: float = 0.5,
        temperature: float | None = None,
        match_weight: float = 0.5,
        assistant_chars: int = 200,
        cache_size: int = 65_536,
    ) -> None:
        self.window = _int_at_least("window", window, 1)
        self.assistant_chars = _int_at_least("assistant_chars", assistant_chars, 0)
        self.cache_size = _int_at_least("cache_size", cache_size, 0)
        self.switch_cost = _finite("switch_cost", switch_cost, low=0.0)
        self.switch_share = _finite("switch_share", switch_share, low=0.0, high=1.0)
        self.match_weight = _finite("match_weight", match_weight, low=0.0)
        self.temperature = (
            None if temperature is None else _finite("temperature", temperature, low=1e-6)
        )
        self._caches: weakref.WeakKeyDictionary[object, OrderedDict[bytes, _Turn]] = (
            weakref.WeakKeyDictionary()
        )

    def __repr__(self) -> str:
        temperature = "per mode" if self.temperature is None else self.temperature
        return (
            f"ConversationPolicy(window={self.window}, switch_cost={self.switch_cost}, "
            f"switch_share={self.switch_share}, temperature={temperature}, "
            f"match_weight={self.match_weight}, assistant_chars={self.assistant_chars})"
        )

    def temperature_for(self, router: RouteScorer) -> float:
        """The temperature used with `router`: this policy's, else its scoring mode's."""
        if self.temperature is not None:
            return self.temperature
        mode = getattr(getattr(router, "scoring", None), "name", None)
        if not isinstance(mode, str):
            return FALLBACK_TEMPERATURE
        return DEFAULT_TEMPERATURES.get(mode, FALLBACK_TEMPERATURE)

    def turn_texts(self, messages: Sequence[ChatMessage]) -> list[str]:
        """The texts this policy reads from a conversation: one per recent user turn,
        oldest first, each the user's text and the assistant text before it."""
        return [
            self._text(assistant, user) for assistant, user in _recent_turns(messages, self.window)
        ]

    def _text(self, assistant: str, user: str) -> str:
        if self.assistant_chars == 0 or not assistant or assistant.isspace():
            return user
        tail = assistant.strip()
        if len(tail) > self.assistant_chars:
            tail = tail[-self.assistant_chars :]
            cut = tail.find(" ")
            if 0 <= cut < len(tail) - 1:
                tail = tail[cut + 1 :]
        return f"{user}\n{tail}"

    async def decide(
        self, router: RouteScorer, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[RouteDecision]:
        texts = [self.turn_texts(messages) for messages in conversations]
        cache = self._caches.get(router)
        if cache is None:
            cache = self._caches.setdefault(router, OrderedDict())
        keys = [[_digest(text) for text in turns] for turns in texts]
        found: dict[bytes, _Turn] = {}
        wanted: dict[bytes, str] = {}
        for turns, turn_keys in zip(texts, keys, strict=True):
            for text, key in zip(turns, turn_keys, strict=True):
                if key in found or key in wanted:
                    continue
                hit = cache.get(key)
                if hit is None:
                    wanted[key] = text
                else:
                    cache.move_to_end(key)
                    found[key] = hit
        if wanted:
            scale = _scale(router)
            columns = {id(client): j for j, client in enumerate(router.clients)}
            fresh = await router.score_routes(list(wanted.values()))
            for key, (scores, matches) in zip(wanted, fresh, strict=True):
                turn = _Turn(scores, matches, self._evidence(scores, matches, columns, scale))
                found[key] = turn
                if self.cache_size:
                    cache[key] = turn
            while len(cache) > self.cache_size:
                cache.popitem(last=False)
        return [self._replay(router, [found[key] for key in turn_keys]) for turn_keys in keys]

    def _evidence(
        self,
        scores: npt.NDArray[np.float32],
        matches: tuple[RouteMatch, ...],
        columns: dict[int, int],
        scale: float,
    ) -> npt.NDArray[np.float64] | None:
        """A turn's evidence per route, or None when the turn has no finite score."""
        evidence = np.where(np.isnan(scores), -np.inf, scores).astype(np.float64)
        if not np.isfinite(evidence).any():
            return None
        if self.match_weight and matches:
            weight = self.match_weight * scale / len(matches)
            for match in matches:
                column = columns.get(id(match.client))
                if column is not None and math.isfinite(match.score):
                    evidence[column] += weight * match.score
        return evidence

    def _replay(self, router: RouteScorer, turns: list[_Turn]) -> RouteDecision:
        clients = router.clients
        if not turns:
            return ConversationDecision(client=router.default_client)
        thresholds = [router.threshold_for(client) for client in clients]
        scale = _scale(router)
        path = _Path(
            cost=self.switch_cost * scale,
            share=self.switch_share,
            temperature=self.temperature_for(router) * scale,
        )
        for turn in turns[:-1]:
            path.step(turn, thresholds)
        before = path.route
        path.step(turns[-1], thresholds)
        current = path.route
        scores, matches = turns[-1].scores, turns[-1].matches
        outcome: TurnOutcome = "new" if before < 0 else "kept" if current == before else "switched"
        finite = [(float(scores[j]), j) for j in range(len(clients)) if math.isfinite(scores[j])]
        if not finite:
            return ConversationDecision(
                client=clients[current] if current >= 0 else router.default_client,
                is_default=current < 0,
                outcome=outcome,
                conversation_client=clients[before] if before >= 0 else None,
                turns_read=len(turns),
            )
        finite.sort(key=lambda pair: (-pair[0], pair[1]))
        best = finite[0][1]
        rival = next((j for _, j in finite if j != before), None) if before >= 0 else best
        return ConversationDecision(
            client=clients[current] if current >= 0 else router.default_client,
            score=float(scores[current]) if current >= 0 else float(scores[best]),
            scores={clients[j]: value for value, j in finite},
            matches=matches,
            is_default=current < 0,
            winner=clients[best],
            threshold=thresholds[best],
            outcome=outcome,
            conversation_client=clients[before] if before >= 0 else None,
            conversation_score=float(scores[before]) if before >= 0 else None,
            challenger_client=clients[rival] if rival is not None else None,
            challenger_score=float(scores[rival]) if rival is not None else None,
            turns_read=len(turns),
        )


@dataclass(frozen=True)
class _Turn:
    """One turn's route scores and matches (from `score_routes`) and its evidence."""

    scores: npt.NDArray[np.float32]
    matches: tuple[RouteMatch, ...]
    evidence: npt.NDArray[np.float64] | None


class _Path:
    """The best path over routes through a conversation's turns, one turn at a time.

    `totals[r]` is the evidence of the best path that ends on route r; `route` is the
    conversation's route (-1 before a turn has opened it).
    """

    __slots__ = ("cost", "route", "share", "temperature", "totals")

    def __init__(self, *, cost: float, share: float, temperature: float) -> None:
        self.cost = cost
        self.share = share
        self.temperature = temperature
        self.totals: npt.NDArray[np.float64] | None = None
        self.route = -1

    def step(self, turn: _Turn, thresholds: list[float]) -> None:
        evidence = turn.evidence
        if evidence is None:  # a blank text or a zero-norm embedding: no evidence
            return
        totals = self.totals
        if totals is None:
            scores = turn.scores
            best = _first_best(scores)
            if not scores[best] >= thresholds[best]:
                return
            # The opening turn's route is its single-message winner; a path that starts
            # on another route pays one move.
            opened = evidence - self.cost
            opened[best] = evidence[best]
            self.totals = opened
            self.route = best
            return
        top = float(evidence.max())
        weights = np.exp((evidence - top) / self.temperature)
        movable = weights >= self.share * float(weights.sum())
        moved = float(totals.max()) - self.cost
        self.totals = np.where(movable, np.maximum(totals, moved), totals) + evidence
        self.route = _first_best(self.totals)


def _first_best(values: npt.NDArray[np.floating]) -> int:
    """The index of the largest value, the lowest index on ties (NaN never wins)."""
    return int(np.argmax(np.where(np.isnan(values), -np.inf, values)))


def _scale(router: RouteScorer) -> float:
    limit = getattr(router, "score_limit", 1.0)
    return float(limit) if isinstance(limit, int | float) and limit > 0 else 1.0


def context_policy(name: str | ContextPolicy | None) -> ContextPolicy:
    """The policy a config names: "last_user" or "conversation" (default parameters), or
    a policy object as is; None gives "last_user"."""
    if name is None or name == "last_user":
        return LastUserPolicy()
    if name == "conversation":
        return ConversationPolicy()
    if isinstance(name, str):
        raise ValueError(f"unknown context policy {name!r}: use 'last_user' or 'conversation'")
    if not isinstance(name, ContextPolicy):
        raise TypeError(f"context must be a policy name or a ContextPolicy, got {name!r}")
    return name


def _int_at_least(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")
    return value


def _finite(name: str, value: object, *, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or number < low or (high is not None and number > high):
        bound = f" >= {low:g}" if high is None else f" in [{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number{bound}, got {value}")
    return number


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _last_user_text(messages: Sequence[ChatMessage]) -> str | None:
    for message in reversed(messages):
        if message.role is ChatRole.USER:
            return message.text
    return None


def _recent_turns(messages: Sequence[ChatMessage], window: int) -> list[tuple[str, str]]:
    """(assistant text before it, user text) for the last `window` user turns with text,
    oldest first; tool and system messages are skipped, as are empty assistant messages
    (a tool call's), so the text before a turn is the assistant's last visible words."""
    turns: list[tuple[str, str]] = []
    pending: str | None = None  # a user text waiting for the assistant text before it
    for message in reversed(messages):
        role = message.role
        if role is ChatRole.USER:
            text = message.text
            if pending is not None:
                turns.append(("", pending))
                if len(turns) == window:
                    break
            pending = text if text and not text.isspace() else None
        elif role is ChatRole.ASSISTANT and pending is not None:
            text = message.text
            if text and not text.isspace():
                turns.append((text, pending))
                pending = None
                if len(turns) == window:
                    break
    else:
        if pending is not None:
            turns.append(("", pending))
    turns.reverse()
    return turns
