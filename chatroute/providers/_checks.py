"""Argument checks every provider client makes, at construction and on each call."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from chatroute.chat.types import ChatMessage, ChatOptions


def check_client_args(
    *,
    model: object,
    max_connections: int,
    max_keepalive_connections: int,
    context_window: int | None,
    extra_body: Mapping[str, Any] | None,
    reserved_body_keys: frozenset[str],
) -> None:
    """Raise ValueError for a constructor argument no provider client accepts."""
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError("model must be a non-empty string or None")
    if max_connections < 1 or max_keepalive_connections < 0:
        raise ValueError("max_connections must be >= 1 and max_keepalive_connections >= 0")
    if context_window is not None and context_window < 1:
        raise ValueError("context_window must be a positive token count")
    if extra_body and reserved_body_keys & set(extra_body):
        raise ValueError(f"extra_body may not set {sorted(reserved_body_keys & set(extra_body))}")


def check_call_args(messages: Sequence[ChatMessage] | None, options: object) -> None:
    """Raise TypeError for a call's messages or options of the wrong kind."""
    if messages is None:
        raise TypeError("messages must not be None")
    if options is not None and not isinstance(options, ChatOptions):
        raise TypeError(f"options must be ChatOptions or None, got {type(options).__name__}")
