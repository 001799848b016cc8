"""Config sections for conversations: the context policy's parameters and sticky sessions."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ConversationConfig", "SessionsConfig"]

_Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ConversationConfig(BaseModel):
    """The `conversation` context policy's parameters (`routing.conversation`).

    The last `window` user turns are read, each followed by the last `assistant_chars`
    characters of the assistant text before it. A turn's evidence for a route is its
    score plus `match_weight` times the route's share of the turn's nearest example
    utterances; the conversation moves to another route only at a turn where that route
    takes at least `switch_share` of the turn's evidence (softmax at `temperature`; null:
    the scoring mode's default) and its path beats staying by `switch_cost`.
    `cache_size` turns are kept per router (0: none). The defaults were chosen on a
    multi-turn dev set (docs/conversations.md).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    window: int = Field(default=6, ge=1, le=64)
    switch_cost: float = Field(default=0.26, ge=0, allow_inf_nan=False)
    switch_share: float = Field(default=0.5, ge=0, le=1, allow_inf_nan=False)
    temperature: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    match_weight: float = Field(default=0.5, ge=0, allow_inf_nan=False)
    assistant_chars: int = Field(default=200, ge=0)
    cache_size: int = Field(default=65_536, ge=0)


class SessionsConfig(BaseModel):
    """Sticky sessions: a conversation stays on the provider that served it while that
    provider is healthy (`sessions`).

    A request belongs to a conversation by its `x-chatroute-session` header, else by its
    `user` or `prompt_cache_key` with a hash of its opening messages; a request with none
    of these has no session. Records live `ttl` seconds after a conversation's last
    answer: in this process (at most `max_sessions`, least recently used dropped first),
    or in Redis when `shared_state` names one, where a read waits at most
    `redis_timeout` seconds and after a fault Redis is left alone for
    `redis_retry_after` seconds (requests are then routed as new conversations).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    ttl: _Seconds = 3600.0
    max_sessions: int = Field(default=100_000, ge=1)
    redis_timeout: _Seconds = 0.05
    redis_retry_after: _Seconds = 5.0
