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
    """What a context policy needs of a router (`SemanticRoutingChatClient` is one)."""

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
      the conversation's route, "switched" when another route won by the margin.
    - `conversation_client` / `conversation_score`: the route the conversation was on
      before this turn (None when "new") and its score on this turn.
    - `challenger_client` / `challenger_score`: the best route other than the
      conversation's on this turn (None when there is none), the one a switch goes to.
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


class ConversationPolicy:
    """Routes a user turn by what it says in its conversation (the service's default).

    Each of the last `window` user turns is read together with the assistant text just
    before it (the last `assistant_chars` characters of it, so a long answer can neither
    crowd the user's words out of the model's input nor make the decision cost much more
    than a single message's), and scored against every route (`score_routes`). Replaying
    those turns in order gives the conversation's route: the first turn whose best route
    reaches its threshold opens it, and a later turn moves it only when its best route
    reaches its threshold and beats the conversation's route on that turn by `margin`,
    or by `confident_margin` when that best route scores at least `confident_score`. The
    last turn's decision is where the replay ends; older turns are not read, so the work
    per request is bounded by `window`.

    Each turn's scores depend on its own text only, so they are kept in an LRU cache of
    `cache_size` turns per router, keyed by a hash of the text: a request embeds only the
    turns not seen before (usually just the new one), all conversations of a batch in one
    embedding call. Decisions depend on the messages alone, so every replica decides a
    conversation the same way. The defaults were chosen on a multi-turn dev set with the
    default model and the service's top-5 mean scoring (see docs/conversations.md).
    """

    name = "conversation"

    def __init__(
        self,
        *,
        window: int = 6,
        margin: float = 0.15,
        confident_margin: float = 0.06,
        confident_score: float = 0.45,
        assistant_chars: int = 200,
        cache_size: int = 65_536,
    ) -> None:
        self.window = _int_at_least("window", window, 1)
        self.assistant_chars = _int_at_least("assistant_chars", assistant_chars, 0)
        self.cache_size = _int_at_least("cache_size", cache_size, 0)
        self.margin = _finite("margin", margin, low=0.0)
        self.confident_margin = _finite("confident_margin", confident_margin, low=0.0)
        self.confident_score = _finite("confident_score", confident_score, low=None)
        self._caches: weakref.WeakKeyDictionary[object, OrderedDict[bytes, TurnScores]] = (
            weakref.WeakKeyDictionary()
        )

    def __repr__(self) -> str:
        return (
            f"ConversationPolicy(window={self.window}, margin={self.margin}, "
            f"confident_margin={self.confident_margin}, "
            f"confident_score={self.confident_score}, assistant_chars={self.assistant_chars})"
        )

    def turn_texts(self, messages: Sequence[ChatMessage]) -> list[str]:
        """The texts this policy reads from a conversation: one per recent user turn,
        oldest first, each the assistant text before it and the user's text."""
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
        return f"{tail}\n{user}"

    async def decide(
        self, router: RouteScorer, conversations: Sequence[Sequence[ChatMessage]]
    ) -> list[RouteDecision]:
        texts = [self.turn_texts(messages) for messages in conversations]
        cache = self._caches.get(router)
        if cache is None:
            cache = self._caches.setdefault(router, OrderedDict())
        keys = [[_digest(text) for text in turns] for turns in texts]
        found: dict[bytes, TurnScores] = {}
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
            fresh = await router.score_routes(list(wanted.values()))
            for key, scores in zip(wanted, fresh, strict=True):
                found[key] = scores
                if self.cache_size:
                    cache[key] = scores
            while len(cache) > self.cache_size:
                cache.popitem(last=False)
        return [self._replay(router, [found[key] for key in turn_keys]) for turn_keys in keys]

    def _replay(self, router: RouteScorer, turns: list[TurnScores]) -> RouteDecision:
        clients = router.clients
        if not turns:
            return ConversationDecision(client=router.default_client)
        thresholds = [router.threshold_for(client) for client in clients]
        current = -1
        before = -1
        for scores, _ in turns:
            before = current
            best = int(np.argmax(scores))
            top = float(scores[best])
            if not math.isfinite(top) or top < thresholds[best] or best == current:
                continue
            if current < 0 or top - float(scores[current]) >= self._margin_for(top):
                current = best
        scores, matches = turns[-1]
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

    def _margin_for(self, score: float) -> float:
        return self.confident_margin if score >= self.confident_score else self.margin


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


def _finite(name: str, value: object, *, low: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number) or (low is not None and number < low):
        bound = "" if low is None else f" >= {low:g}"
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
