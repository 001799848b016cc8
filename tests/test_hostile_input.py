"""Hostile and malformed requests against the real service: a clear 4xx each, never 5xx or a hang.

Sizes, counts and lengths over the limits, deep nesting, bad encodings, non-finite numbers,
wrong types, unknown fields (accepted and ignored) and slow senders. Nothing here may reach
an upstream, except the requests that are valid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import ServiceStack

MAX_BODY = 65_536
MAX_MESSAGES = 16
MAX_CHARS = 2_000
MAX_DEPTH = 32
BODY_TIMEOUT = 0.5


def build(urls: dict[str, str]) -> dict[str, Any]:
    return {
        "server": {
            "max_body_bytes": MAX_BODY,
            "max_messages": MAX_MESSAGES,
            "max_message_chars": MAX_CHARS,
            "max_json_depth": MAX_DEPTH,
            "max_classify_inputs": 8,
            "body_timeout": BODY_TIMEOUT,
        },
        "routing": {"default_route": "chain", "threshold": 0.3},
        "providers": {"primary": {"base_url": urls["primary"], "model": "primary-model"}},
        "routes": {"chain": {"targets": ["primary"], "utterances": ["hello there"]}},
    }


@pytest.fixture(scope="module")
def stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
) -> Iterator[ServiceStack]:
    with service_stack(build, ["primary"]) as made:
        yield made


@pytest.fixture(autouse=True)
def fresh(stack: ServiceStack) -> None:
    stack.reset()


USER = {"role": "user", "content": "hello there"}
MESSAGE = json.dumps({"role": "user", "content": "x"})


def post(
    stack: ServiceStack,
    body: bytes | dict[str, Any],
    path: str = "/v1/chat/completions",
    content_type: str = "application/json",
) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return stack.http.post(path, content=content, headers={"content-type": content_type})


def assert_4xx(
    response: Any, status: int, code: str | None = None, param: str | None = None
) -> Any:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def nested(depth: int, leaf: str = "1") -> str:
    return (
        '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)
        if leaf == "obj"
        else ("[" * depth + leaf + "]" * depth)
    )


# -------------------------------------------------------------------------------- sizes


def test_body_over_the_limit_is_413_declared_or_streamed(stack: ServiceStack) -> None:
    big = {"messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    assert_4xx(post(stack, big), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(20):
            yield b"y" * 8192
        yield b'"}]}'

    r = stack.http.post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_4xx(r, 413, "request_too_large")
    assert stack.attempts()["primary"] == 0


def test_message_count_and_length_limits(stack: ServiceStack) -> None:
    error = assert_4xx(post(stack, {"messages": [USER] * (MAX_MESSAGES + 1)}), 400, "too_many")
    assert error["param"] == "messages"
    long = {"role": "user", "content": "z" * (MAX_CHARS + 1)}
    assert_4xx(
        post(stack, {"messages": [USER, long]}), 400, "message_too_long", "messages[1].content"
    )
    parts = {"role": "user", "content": [{"type": "text", "text": "p" * 1500}] * 2}
    assert_4xx(post(stack, {"messages": [parts]}), 400, "message_too_long", "messages[0].content")
    assert_4xx(
        post(stack, {"input": "q" * (MAX_CHARS + 1)}, "/v1/route"), 400, "message_too_long", "input"
    )
    assert_4xx(
        post(stack, {"inputs": ["ok", "q" * (MAX_CHARS + 1)]}, "/v1/classify"),
        400,
        "message_too_long",
        "inputs[1]",
    )
    assert_4xx(post(stack, {"inputs": ["x"] * 9}, "/v1/classify"), 400, "too_many")
    at_limit = {"role": "user", "content": "z" * MAX_CHARS}
    assert post(stack, {"model": "chain", "messages": [at_limit]}).status_code == 200
    assert stack.attempts()["primary"] == 1


def test_long_unknown_model_name_is_404_without_echoing_it_all(stack: ServiceStack) -> None:
    error = assert_4xx(
        post(stack, {"model": "m" * 5000, "messages": [USER]}), 404, "model_not_found"
    )
    assert len(error["message"]) < 300


# ------------------------------------------------------------------------------ nesting


@pytest.mark.parametrize("shape", ["array", "obj"])
def test_nesting_deeper_than_the_limit_is_400(stack: ServiceStack, shape: str) -> None:
    leaf = "1" if shape == "array" else "obj"
    deep = f'{{"messages": [{MESSAGE}], "metadata": {nested(MAX_DEPTH, leaf)}}}'
    error = assert_4xx(post(stack, deep.encode()), 400, "invalid_body")
    assert f"{MAX_DEPTH} levels" in error["message"]
    very = b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"
    assert_4xx(post(stack, very), 400, "invalid_body")
    assert_4xx(post(stack, b"[" * 60_000, "/v1/route"), 400)
    assert stack.attempts()["primary"] == 0


def test_nesting_within_the_limit_reaches_the_upstream(stack: ServiceStack) -> None:
    schema = nested(MAX_DEPTH - 3, "obj")  # top object + response_format + json_schema
    response_format = f'{{"type": "json_schema", "json_schema": {schema}}}'
    body = f'{{"model": "chain", "messages": [{MESSAGE}], "response_format": {response_format}}}'
    assert post(stack, body.encode()).status_code == 200
    assert stack.upstreams["primary"].requests[0].json["response_format"]["type"] == "json_schema"


# ---------------------------------------------------------------------------- encodings


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [{"role": "user", "content": "\xff\xfe bad"}]}',
        b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}',
        b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # an encoded surrogate
        '{"messages": [{"role": "user", "content": "x"}]}'.encode("utf-16"),
    ],
    ids=["ff-fe", "bad-continuation", "cesu-surrogate", "utf-16"],
)
def test_bytes_that_are_not_utf8_are_400(stack: ServiceStack, body: bytes) -> None:
    assert_4xx(post(stack, body), 400, "invalid_encoding")
    assert stack.attempts()["primary"] == 0


def test_unpaired_surrogate_escapes_are_400_but_pairs_are_text(stack: ServiceStack) -> None:
    lone = b'{"model": "chain", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    assert_4xx(post(stack, lone), 400, "invalid_encoding")
    key = b'{"model": "chain", "messages": [{"role": "user", "content": "a"}], "\\udfff": 1}'
    assert_4xx(post(stack, key), 400, "invalid_encoding")
    pair = b'{"model": "chain", "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    assert post(stack, pair).status_code == 200
    assert stack.upstreams["primary"].requests[0].messages[0]["content"] == "smile \U0001f600"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_400(stack: ServiceStack, constant: str) -> None:
    body = f'{{"model": "chain", "messages": [{MESSAGE}], "logit_bias": {{"50256": {constant}}}}}'
    assert_4xx(post(stack, body.encode()), 400, "invalid_json")
    assert stack.attempts()["primary"] == 0


def test_huge_integers_and_broken_json_are_400(stack: ServiceStack) -> None:
    huge = b'{"messages": [{"role": "user", "content": "x"}], "seed": ' + b"9" * 5000 + b"}"
    assert_4xx(post(stack, huge), 400)
    for broken in (b"{", b'{"messages": [}', b"\x00\x00", b'{"a": 1}{"b": 2}', b"   "):
        assert_4xx(post(stack, broken), 400)
    assert stack.attempts()["primary"] == 0


# -------------------------------------------------------------------------- types, fields


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("stream", "yes", "stream"),
        ("stream", 1, "stream"),
        ("temperature", "0.5", "temperature"),
        ("max_tokens", 1.5, "max_tokens"),
        ("max_tokens", True, "max_tokens"),
        ("model", 5, "model"),
        ("messages", {"role": "user", "content": "x"}, "messages"),
        ("messages", [{"role": "user", "content": 5}], "messages[0].content"),
        ("messages", [{"role": "user", "content": ["x"]}], "messages[0].content"),
        ("messages", [{"role": 1, "content": "x"}], "messages[0].role"),
        ("messages", ["hello"], "messages[0]"),
        ("stop", [1, 2], "stop"),
        ("tools", [{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ("n", 0, "n"),
        ("n", 129, "n"),
        ("stream_options", {"include_usage": "true"}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_are_400_naming_the_field(
    stack: ServiceStack, field: str, value: Any, param: str
) -> None:
    body: dict[str, Any] = {"model": "chain", "messages": [USER], field: value}
    error = assert_4xx(post(stack, body), 400)
    assert error["param"] is not None and error["param"].startswith(param), error
    assert stack.attempts()["primary"] == 0


def test_unknown_top_level_fields_are_passed_on_as_sent(stack: ServiceStack) -> None:
    body = {
        "model": "chain",
        "messages": [USER],
        "top_k": 40,
        "repetition_penalty": 1.1,
        "x" * 600: {"nested": [1, 2, 3]},
    }
    r = post(stack, body)
    assert r.status_code == 200
    assert r.headers.get("x-chatroute-ignored-params") is None  # nothing was dropped
    sent = stack.upstreams["primary"].requests[0].json
    assert sent["top_k"] == 40 and sent["repetition_penalty"] == 1.1
    assert sent["x" * 600] == {"nested": [1, 2, 3]}


def test_unknown_fields_inside_messages_are_ignored(stack: ServiceStack) -> None:
    message = {"role": "user", "content": "x", "refusal": None, "annotations": []}
    assert post(stack, {"model": "chain", "messages": [message]}).status_code == 200


def test_own_apis_reject_unknown_fields(stack: ServiceStack) -> None:
    assert_4xx(post(stack, {"input": "x", "extra": 1}, "/v1/route"), 400, param="extra")


def test_wrong_content_type_and_empty_bodies_are_400(stack: ServiceStack) -> None:
    assert_4xx(post(stack, {"messages": [USER]}, content_type="text/plain"), 400, "invalid_body")
    assert_4xx(post(stack, b""), 400)
    assert_4xx(post(stack, b"[]"), 400)
    assert_4xx(post(stack, b"null"), 400)


# ---------------------------------------------------------------------------- slow senders


async def test_a_body_that_never_arrives_is_408_not_a_hang(stack: ServiceStack) -> None:
    parts = urlsplit(stack.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"authorization: Bearer {stack.key}\r\ncontent-type: application/json\r\n"
        'content-length: 100\r\n\r\n{"messages": '
    )
    writer.write(head.encode())
    await writer.drain()
    async with asyncio.timeout(BODY_TIMEOUT + 5):
        answer = await reader.read()  # to the end: the service closes the connection
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"request_timeout" in answer
    assert stack.attempts()["primary"] == 0


async def test_a_declared_length_over_the_limit_is_413_before_the_body_is_awaited(
    stack: ServiceStack,
) -> None:
    parts = urlsplit(stack.url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        f"authorization: Bearer {stack.key}\r\ncontent-type: application/json\r\n"
        f"content-length: {MAX_BODY + 1}\r\n\r\n"  # one byte over, and none of it sent
    )
    writer.write(head.encode())
    await writer.drain()
    async with asyncio.timeout(BODY_TIMEOUT / 2):  # well before the body timeout could fire
        answer = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert stack.attempts()["primary"] == 0


def test_cross_origin_access_is_off_by_default(stack: ServiceStack) -> None:
    import httpx

    preflight = httpx.options(
        f"{stack.url}/v1/chat/completions",
        headers={"origin": "https://app.example", "access-control-request-method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
