"""Pass-through: which of a caller's request fields that chatroute does not know a provider
forwards, and how a provider reports what it did not send."""

from __future__ import annotations

from typing import Any, Literal

from chatroute.chat.types import ChatOptions, ChatResponse, ChatResponseUpdate

__all__ = ["IGNORED_PARAMS", "PassThrough", "passed_extras", "report_ignored"]

PassThrough = Literal["all", "none"] | frozenset[str]
"""Which of the caller's unknown request fields a provider forwards: all, none, or those
named."""

IGNORED_PARAMS = "ignored_params"
"""The key of an answer's `additional_properties` (a non-streamed answer, or a stream's
first update) under which a provider lists the request fields it did not send."""


def passed_extras(
    options: ChatOptions | None, pass_through: PassThrough
) -> tuple[dict[str, Any], list[str]]:
    """The `additional_properties` a provider sends, and the names of the caller's unknown
    fields (`pass_through_fields`) that `pass_through` drops, sorted."""
    if options is None or not options.additional_properties:
        return {}, []
    extras = dict(options.additional_properties)
    callers = options.pass_through_fields
    if pass_through == "all" or not callers:
        return extras, []
    dropped = sorted(
        key for key in callers & extras.keys() if pass_through == "none" or key not in pass_through
    )
    for key in dropped:
        del extras[key]
    return extras, dropped


def report_ignored(answer: ChatResponse | ChatResponseUpdate, ignored: list[str]) -> None:
    """List the fields a provider did not send in `answer`'s properties (when there are)."""
    if ignored:
        answer.additional_properties = {
            **(answer.additional_properties or {}),
            IGNORED_PARAMS: ignored,
        }
