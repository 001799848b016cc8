"""What one input row of `chatroute classify` means: its query text, or why it is unusable."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError

from chatroute.chat.types import ChatMessage
from chatroute.server.errors import APIError

if TYPE_CHECKING:
    from chatroute.server.wire import WireMessage

__all__ = ["BadLine", "ConversationText", "messages_query", "parse_input_line", "resume_point"]


# The request models load with the first messages row, not with this module: a Ray worker
# that reads or decides plain-text rows imports it too (the models cost ~0.2 s of CPU there).
@functools.cache
def _messages_adapter() -> TypeAdapter[list[WireMessage]]:
    from chatroute.server.wire import WireMessage

    return TypeAdapter(list[WireMessage])


@dataclass(frozen=True)
class BadLine:
    """An input row that could not be classified, and why (`line`: its line or row number)."""

    line: int
    reason: str


class ConversationText(str):
    """A messages row's query: its last user turn as text, carrying the conversation it ends
    (`messages`) so that a conversation-aware router decides the turn in context, and that
    conversation as JSON (`source`) for engines that ship rows between processes."""

    messages: tuple[ChatMessage, ...]
    source: str

    def __new__(cls, text: str, messages: tuple[ChatMessage, ...], source: str) -> ConversationText:
        query = super().__new__(cls, text)
        query.messages = messages
        query.source = source
        return query


def messages_query(messages: Any) -> ConversationText:
    """The query of an OpenAI-shaped `messages` list (a JSON text or a list): its last user
    turn, with the conversation it ends.

    The one place a conversation becomes a query for bulk classification. Raises
    ValueError for a list that is not valid chat messages.
    """
    source = messages if isinstance(messages, str) else None
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except ValueError as exc:
            raise ValueError(f"messages are not valid JSON ({exc})") from None
    from chatroute.server.wire import query_text, to_chat_messages

    try:
        wire = _messages_adapter().validate_python(messages)
        chat = tuple(to_chat_messages(wire))
        if source is None:
            source = json.dumps(messages, ensure_ascii=False, default=str)
        return ConversationText(query_text(chat), chat, source)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"bad messages ({where}: {first['msg']})") from None
    except APIError as exc:
        raise ValueError(f"bad messages ({exc.message})") from None


def parse_input_line(text: str) -> tuple[str, Any]:
    """The query text of one JSONL line and its `id` (None when absent).

    A line is a JSON string, `{"input": "..."}` or `{"messages": [...]}` (the OpenAI
    message shape; the last user message is the query). Raises ValueError otherwise.
    """
    try:
        item = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if isinstance(item, str):
        return item, None
    if not isinstance(item, dict):
        raise ValueError("expected a JSON string or an object with 'input' or 'messages'")
    ident = item.get("id")
    if "input" in item:
        value = item["input"]
        if not isinstance(value, str):
            raise ValueError(f"'input' must be a string, got {type(value).__name__}")
        return value, ident
    if "messages" in item:
        return messages_query(item["messages"]), ident
    raise ValueError("expected a JSON string or an object with 'input' or 'messages'")


def resume_point(output: Path) -> int:
    """The input line number an existing JSONL output reaches (0 when there is none).

    A trailing partial line (an interrupted write) is cut off the file first.
    """
    if not output.exists():
        return 0
    with open(output, "rb+") as fh:
        data = fh.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            fh.truncate(end)
    for raw in reversed(data[:end].splitlines()):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("line"), int):
            return int(record["line"])
    return 0
