"""`parse_json` (orjson, once, with the service's own limits) and the admission's reading of
a body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatroute.server.errors import APIError
from chatroute.server.guard import PARSED_BODY, Admission, parse_json


def refused(body: bytes, max_depth: int = 4) -> tuple[str, str]:
    with pytest.raises(APIError) as caught:
        parse_json(body, max_depth)
    assert caught.value.status == 400
    return caught.value.code or "", caught.value.message


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b'{"a": NaN}', "invalid_json", "the body contains NaN, which is not valid JSON"),
        (b"[-Infinity]", "invalid_json", "the body contains -Infinity, which is not valid JSON"),
        (b'{"a": Infinity}', "invalid_json", "the body contains Infinity, which is not valid JSON"),
        (b'{"logit_bias": {"1": 1e400}}', "invalid_json", "a number too large for JSON"),
        (b'{"a": 1' + b"0" * 400 + b".5}", "invalid_json", "a number too large for JSON"),
        (b'{"content": "a\\ud800b"}', "invalid_encoding", "unpaired UTF-16 surrogate"),
        (b'{"\\udfff": 1}', "invalid_encoding", "unpaired UTF-16 surrogate"),
        (b"\xed\xa0\x80", "invalid_encoding", "not valid UTF-8"),
        (b'{"a": "\xff"}', "invalid_encoding", "not valid UTF-8"),
        (b'{"a": [[[[{"b": "x"}]]]]}', "invalid_body", "nests deeper than 4 levels"),
        (b"[" * 50_000 + b"]" * 50_000, "invalid_body", "nests deeper than 1024 levels"),
        (b'{"a": 1, ', "invalid_json", "the body is not valid JSON: unexpected end of data"),
        (b"", "invalid_json", "the body is not valid JSON"),
        (b"nan", "invalid_json", "the body is not valid JSON"),
    ],
)
def test_what_orjson_refuses_is_a_400_that_says_why(body: bytes, code: str, message: str) -> None:
    got_code, got_message = refused(body)
    assert got_code == code and message in got_message


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}',
        b'{"content": "[[[[[[{{{{{{"}',  # brackets inside strings nest nothing
        b'{"a": [[{"b": "x"}]]}',  # four levels: the limit
        b'{"content": "caf\\u00e9 \\\\ud800 \\ud83d\\ude00"}',  # escapes and pairs
        b'{"seed": 1.7976931348623157e308, "t": -0.0, "n": 12345678901234567890}',
        b"null",
    ],
)
def test_json_the_stdlib_reads_alike_is_taken_as_it_reads_it(body: bytes) -> None:
    assert parse_json(body, 4) == json.loads(body)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from(["a", "[", "{", "\\", "u", "é", "\U0001f600"])),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children),
    max_leaves=12,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@settings(max_examples=100, deadline=None)
@given(value=_json_values, ascii_only=st.booleans(), depth=st.integers(1, 6))
def test_any_json_body_is_its_value_or_too_deep(value: Any, ascii_only: bool, depth: int) -> None:
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    if _depth(value) > depth:
        assert refused(body, depth) == (
            "invalid_body",
            f"the JSON body nests deeper than {depth} levels",
        )
    else:
        assert parse_json(body, depth) == value


# ------------------------------------------------------------------ reading the body


async def test_a_caller_leaving_mid_body_is_not_answered_as_an_empty_body() -> None:
    admission = Admission(api_keys=[], max_body_bytes=1024, body_timeout=1.0)
    messages = [
        {"type": "http.request", "body": b'{"messages": ', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/chat/completions", "headers": []}
    assert await admission.admit_body(scope, receive, send) is None  # type: ignore[arg-type]
    assert sent == []  # nobody is left to answer


async def test_a_v1_json_body_is_parsed_once_and_left_in_the_scope() -> None:
    admission = Admission(api_keys=[], max_body_bytes=1024, body_timeout=1.0)
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: Any) -> None:
        raise AssertionError("nothing to answer")

    for ctype, parsed in [(b"application/json", True), (b"text/plain", False)]:
        scope: dict[str, Any] = {
            "type": "http",
            "path": "/v1/chat/completions",
            "headers": [(b"content-type", ctype)],
        }
        messages.append({"type": "http.request", "body": body, "more_body": False})
        assert await admission.admit_body(scope, receive, send) == body  # type: ignore[arg-type]
        assert (PARSED_BODY in scope) is parsed
        if parsed:
            assert scope[PARSED_BODY] == json.loads(body)
