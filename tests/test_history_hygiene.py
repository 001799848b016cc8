"""History hygiene: reasoning one provider family left is not forwarded to the other family."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from chatroute.chat.types import (
    ChatMessage,
    ChatRole,
    FunctionCallContent,
    FunctionResultContent,
    TextContent,
    TextReasoningContent,
)
from chatroute.providers import OpenAIChatClient
from chatroute.providers.anthropic_messages import AnthropicChatClient
from chatroute.session import (
    HistoryHygieneChatClient,
    SessionRecord,
    SessionScope,
    bind_session,
    clean_history,
)
from tests.fakes import FakeUpstream, Ok
from tests.fakes.anthropic import FakeAnthropic


@pytest.fixture
def openai_up() -> Iterator[FakeUpstream]:
    with FakeUpstream(default=Ok("from openai", reasoning="openai thoughts")) as server:
        yield server


@pytest.fixture
def anthropic_up() -> Iterator[FakeAnthropic]:
    with FakeAnthropic(default=Ok("from claude", reasoning="claude thoughts")) as server:
        yield server


def _assistant_of(body: Any) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "assistant"]


async def test_anthropic_thinking_is_not_forwarded_to_an_openai_provider(
    openai_up: FakeUpstream, anthropic_up: FakeAnthropic
) -> None:
    claude = AnthropicChatClient("claude-test", base_url=anthropic_up.url, name="claude")
    gpt = OpenAIChatClient("gpt-test", base_url=openai_up.base_url, name="gpt")
    try:
        history = [ChatMessage(ChatRole.USER, "plan my trip")]
        answer = await claude.get_response(history)
        produced = answer.messages[0]
        signed = [c for c in produced.contents if isinstance(c, TextReasoningContent)]
        assert signed and signed[0].protected_data  # the fake signs its thinking
        history += [produced, ChatMessage(ChatRole.USER, "and a hotel")]

        await gpt.get_response(history)  # without hygiene the thinking goes along
        assert _assistant_of(openai_up.requests[-1].json)[0].get("reasoning_content")

        await HistoryHygieneChatClient(gpt, "openai").get_response(history)
        sent = _assistant_of(openai_up.requests[-1].json)[0]
        assert "reasoning_content" not in sent
        assert sent["content"] == "from claude"
        assert produced.contents == answer.messages[0].contents  # the caller's message is kept
    finally:
        await claude.aclose()
        await gpt.aclose()


async def test_openai_reasoning_is_not_forwarded_to_an_anthropic_provider(
    openai_up: FakeUpstream, anthropic_up: FakeAnthropic
) -> None:
    claude = AnthropicChatClient("claude-test", base_url=anthropic_up.url, name="claude")
    gpt = OpenAIChatClient("gpt-test", base_url=openai_up.base_url, name="gpt")
    try:
        history = [ChatMessage(ChatRole.USER, "plan my trip")]
        produced = (await gpt.get_response(history)).messages[0]
        # An OpenAI-family turn whose reasoning came back with opaque (encrypted) data.
        produced.contents.append(TextReasoningContent("", "gAAAA-encrypted-openai-reasoning"))
        produced.additional_properties = {"reasoning_details": [{"type": "reasoning.encrypted"}]}
        history += [produced, ChatMessage(ChatRole.USER, "and a hotel")]

        await claude.get_response(history)  # without hygiene: sent as redacted thinking
        blocks = _assistant_of(anthropic_up.requests[-1].json)[0]["content"]
        assert any(b["type"] == "redacted_thinking" for b in blocks)

        scope = SessionScope(key="s:trip", previous=SessionRecord("travel", "gpt", "openai"))
        bind_session(scope)
        await HistoryHygieneChatClient(claude, "anthropic").get_response(history)
        content = _assistant_of(anthropic_up.requests[-1].json)[0]["content"]
        assert content in ("from openai", [{"type": "text", "text": "from openai"}])
    finally:
        await claude.aclose()
        await gpt.aclose()


def test_same_family_reasoning_is_kept_and_nothing_is_copied() -> None:
    history = [
        ChatMessage(ChatRole.USER, "hi"),
        ChatMessage(
            ChatRole.ASSISTANT,
            contents=[TextReasoningContent("think", "sig"), TextContent("hello")],
        ),
    ]
    assert clean_history(history, "anthropic") is history
    openai_history = [history[0], ChatMessage(ChatRole.ASSISTANT, "x", [TextReasoningContent("r")])]
    assert clean_history(openai_history, "openai") is openai_history


def test_cleaning_keeps_text_tool_calls_and_other_messages() -> None:
    call = FunctionCallContent("c1", "lookup", '{"q": 1}')
    history = [
        ChatMessage(ChatRole.SYSTEM, "sys"),
        ChatMessage(ChatRole.USER, "hi"),
        ChatMessage(
            ChatRole.ASSISTANT,
            contents=[TextReasoningContent("think", "sig"), TextContent("let me look"), call],
            author_name="bot",
        ),
        ChatMessage(ChatRole.TOOL, contents=[FunctionResultContent("c1", "42")]),
        ChatMessage(ChatRole.ASSISTANT, contents=[TextReasoningContent("", "redacted")]),
    ]
    cleaned = clean_history(history, "openai")
    assert cleaned is not history
    assert [m.role for m in cleaned] == [m.role for m in history]
    assert cleaned[2].contents == [TextContent("let me look"), call]
    assert cleaned[2].author_name == "bot"
    assert cleaned[4].contents == []
    assert cleaned[0] is history[0] and cleaned[3] is history[3]
    assert len(history[2].contents) == 3  # the caller's message is untouched


def test_an_explicit_source_family_overrides_what_the_parts_suggest() -> None:
    # Reasoning without protected data, but the session says Anthropic produced it.
    history = [ChatMessage(ChatRole.ASSISTANT, "a", [TextReasoningContent("streamed thinking")])]
    assert clean_history(history, "openai", source="anthropic")[0].contents == [TextContent("a")]
    assert clean_history(history, "openai") is history


def test_unknown_families_are_refused() -> None:
    with pytest.raises(ValueError, match="target"):
        clean_history([], "gemini")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="family"):
        HistoryHygieneChatClient(OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1"), "x")  # type: ignore[arg-type]
