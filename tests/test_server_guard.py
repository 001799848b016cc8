"""`parse_json`'s shortcuts against the full walk (the same data and the same error, always), and
the admission's reading of a body."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatroute.server.errors import APIError
from chatroute.server.guard import Admission, NotJSON, parse_json

_SURROGATE = re.compile("[\ud800-\udfff]")


def _constant(name: str) -> Any:
    raise ValueError(f"the body contains {name}, which is not valid JSON")


def walked(body: bytes, max_depth: int) -> tuple[Any, tuple[Any, ...] | None]:
    """What `parse_json` answers, computed the slow way: parse, then walk every value."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, (400, f"the body is not valid UTF-8 (at byte {exc.start})", "invalid_encoding")
    try:
        data = json.loads(text, parse_constant=_constant)
    except RecursionError:
        return None, (400, f"the JSON body nests deeper than {max_depth} levels", "invalid_body")
    except json.JSONDecodeError as exc:
        return ("not json", str(exc)), None
    except ValueError as exc:
        if str(exc).startswith("the body contains"):
            return None, (400, str(exc), "invalid_json")
        return ("not json", str(exc)), None
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list) and depth > max_depth:
            return None, (
                400,
                f"the JSON body nests deeper than {max_depth} levels",
                "invalid_body",
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key):
                    return None, (
                        400,
                        "the body contains an unpaired UTF-16 surrogate escape",
                        "invalid_encoding",
                    )
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str) and _SURROGATE.search(value):
            return None, (
                400,
                "the body contains an unpaired UTF-16 surrogate escape",
                "invalid_encoding",
            )
        elif isinstance(value, float) and not math.isfinite(value):
            return None, (400, "the body contains a number too large for JSON", "invalid_json")
    return data, None


def parsed(body: bytes, max_depth: int) -> tuple[Any, tuple[Any, ...] | None]:
    data, error = parse_json(body, max_depth)
    if isinstance(data, NotJSON):
        data = ("not json", str(data.error))
    return data, None if error is None else (error.status, error.message, error.code)


def same(body: bytes, max_depth: int = 4) -> None:
    assert parsed(body, max_depth) == walked(body, max_depth), body


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}',
        # Brackets inside strings count towards the bound but nest nothing.
        b'{"content": "[[[[[[{{{{{{"}',
        b'{"a": [[[{"b": "x"}]]]}',
        b'{"a": [[[[{"b": "x"}]]]]}',
        # Escapes that are not surrogates, an escaped backslash before a "u", and pairs.
        b'{"content": "caf\\u00e9 \\\\ud800 \\ud83d\\ude00"}',
        b'{"content": "a\\ud800b"}',
        b'{"\\udfff": 1}',
        b'"\\udc00"',
        # Numbers: large but finite, too large, negative, as keys' values, inside lists.
        b'{"seed": 1.7976931348623157e308, "t": -0.0, "n": 12345678901234567890}',
        b'{"logit_bias": {"50256": 1e400}}',
        b"[-1e999]",
        b'{"a": 1' + b"0" * 400 + b".5}",
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        # Several problems at once: the walk meets them in one order, and so must the shortcut.
        b'{"a": 1e400, "b": "\\ud800"}',
        b'{"b": "\\ud800", "a": 1e400}',
        b'{"a": [[[[[1]]]]], "b": 1e400}',
        b'{"b": 1e400, "a": [[[[[1]]]]]}',
        b'{"a": [[[[["\\ud800"]]]]], "b": [1e400]}',
        b'[1e400, [[[[["x"]]]]]]',
        # Broken JSON after an overflow or a lone surrogate is still not JSON.
        b'{"a": 1e400, ',
        b'{"a": "\\ud800", ',
        b'{"seed": ' + b"9" * 5000 + b"}",
        b"[" * 50_000 + b"]" * 50_000,
        b"\xed\xa0\x80",
        b"",
        b"null",
    ],
)
def test_the_shortcuts_answer_as_the_full_walk(body: bytes) -> None:
    same(body)


def test_deep_nesting_is_refused_whatever_else_the_body_holds() -> None:
    deep = b'{"a": ' + b"[" * 5 + b"]" * 5 + b"}"
    data, error = parse_json(deep, 4)
    assert data is None and isinstance(error, APIError)
    assert error.message == "the JSON body nests deeper than 4 levels"
    assert parse_json(deep, 6)[1] is None


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from(["a", "[", "{", "\\", "u", "é", "\ud800", "\U0001f600"])),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.text(alphabet=st.sampled_from(["k", "[", "\udfff", "\\"]), max_size=3),
            children,
            max_size=3,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=_json_values, ascii_only=st.booleans(), huge=st.booleans(), depth=st.integers(1, 6))
def test_any_json_body_answers_as_the_full_walk(
    value: Any, ascii_only: bool, huge: bool, depth: int
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    if huge:
        text = text.replace("0.0", "1e400")
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate sent as raw text cannot be UTF-8
        body = text.encode("utf-8", "surrogatepass")
    same(body, depth)


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
