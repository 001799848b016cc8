"""orjson in the providers (`chatroute._json`) against the stdlib `json` it stands in for:
the provider's parsing and its encoder give the same values and the same errors as the
stdlib-only code they replaced, for generated and hand-picked inputs."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import math
import random
import re
import struct
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pydantic
import pytest

from chatroute import _json
from chatroute._json import (
    NESTING_SAFE,
    UNKNOWN,
    dumps_plain,
    loads,
    loads_counted,
    loads_exact,
)
from chatroute.providers._sdk_http import _json_default
from chatroute.providers.openai_compat import OpenAIChatClient

# ------------------------------------------------------------- the stdlib-only code

_WIRE = json.JSONEncoder(ensure_ascii=False)


def reference_wire(obj: Any) -> bytes:
    """The server's response / SSE encoding before orjson."""
    return _WIRE.encode(obj).encode()


def reference_upstream(obj: Any) -> bytes:
    """The provider's request body encoding before orjson."""
    return json.dumps(
        obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_json_default
    ).encode()


# ------------------------------------------------------------------------ comparisons


_CLOSE_LIST = object()
_CLOSE_DICT = object()


def typed(value: Any) -> list[Any]:
    """`value` as a flat list of tokens with every type spelled out (True is not 1, 1.0 is
    not 1, -0.0 is not 0.0, NaN equals NaN), dict order kept; no recursion, so that values
    nested as deep as the stdlib reads compare too."""
    tokens: list[Any] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if item is _CLOSE_LIST:
            tokens.append("]")
        elif item is _CLOSE_DICT:
            tokens.append("}")
        elif type(item) is list:
            tokens.append("[")
            stack.append(_CLOSE_LIST)
            stack.extend(reversed(item))
        elif type(item) is dict:
            tokens.append("{")
            stack.append(_CLOSE_DICT)
            for key, child in reversed(item.items()):
                stack.append(child)
                stack.append(("key", type(key).__name__, key))
        elif type(item) is float:
            tokens.append(("float", repr(item)))
        elif type(item) is tuple and item[:1] == ("key",):
            tokens.append(item)
        else:
            tokens.append((type(item).__name__, item))
    return tokens


def _exception(exc: BaseException) -> tuple[Any, ...]:
    return (
        type(exc),
        str(exc),
        getattr(exc, "msg", None),
        getattr(exc, "pos", None),
        getattr(exc, "lineno", None),
        getattr(exc, "colno", None),
    )


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        value = call()
    except Exception as exc:
        return "raised", _exception(exc)
    return "value", typed(value)


def decoded(call: Callable[[], bytes]) -> tuple[str, Any]:
    """What `call` encodes, read back by the stdlib (which reads NaN and Infinity too)."""
    try:
        out = call()
    except Exception as exc:
        return "raised", _exception(exc)
    return "value", typed(json.loads(out))


# --------------------------------------------------------------------- generated JSON

_STRING_PIECES = [
    "a", "Z", " ", "0", "7", "é", "日本", "\U0001f600", "\x7f", "\u2028", "\ufeff", "[", "{",
    "]", "}", ",", ":", "u", "1234567890", "1234567890123456789",
    '\\"', "\\\\", "\\/", "\\n", "\\t", "\\b", "\\f", "\\r", "\\u00e9", "\\u0041", "\\u0000",
    "\\u001f", "\\uffff", "\\ud83d\\ude00", "\\uD83D\\uDE00", "\\\\ud800", "\\ud800",
    "\\udfff", "\\udc00\\ud800", "\\ud800\\u0041", "\\ud800x", "\\ud800\\ud800",
]  # fmt: skip
_RARE_STRING_PIECES = ["\x00", "\x1f", "\t", "\n", "\\x", "\\u12", "\\U0041", "\ud800", "\udfff"]
_NUMBERS = [
    "0", "-0", "1", "-1", "42", "123456789012345678", "-123456789012345678",
    "999999999999999999", "9223372036854775807", "-9223372036854775808",
    "9223372036854775808", "18446744073709551615", "18446744073709551616",
    "-9223372036854775809", "123456789012345678901234567890", "1" + "0" * 400,
    "0.0", "-0.0", "0.5", "1.5", "3.14159", "1e5", "1E5", "1e+5", "1e-5", "2.5E-3",
    "1e308", "1.7976931348623157e308", "1.7976931348623159e308", "1e309", "1e400",
    "-1e400", "1e-400", "5e-324", "2e-324", "2.2250738585072011e-308", "0e99999",
    "123456789.123456789", "0.1234567890123456789", "1.00000000000000011102230246251565",
    "6.02214076e23", "-7.2e-100",
]  # fmt: skip
_BAD_NUMBERS = ["01", "1.", ".5", "+1", "-", "1e", "1e+", "0x10", "1_000", "--1"]
_CONSTANTS = ["true", "false", "null", "NaN", "Infinity", "-Infinity"]
_BAD_CONSTANTS = ["nan", "inf", "True", "None", "undefined", "nul"]
_SPACES = ["", "", "", " ", "  ", "\n", "\t", "\r\n"]
_BAD_SPACES = ["\x0c", "\x0b", "\u00a0", "\u3000"]


class _Gen:
    """Random JSON texts: valid ones mostly, each with a small chance of a bad part."""

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.bad = self.r.random() < 0.3  # whether this text may hold invalid parts
        self.deep = self.r.random() < 0.3  # whether arrays and objects are likelier than leaves

    def rare(self, p: float = 0.03) -> bool:
        return self.bad and self.r.random() < p

    def space(self) -> str:
        if self.rare(0.01):
            return self.r.choice(_BAD_SPACES)
        return self.r.choice(_SPACES)

    def number(self) -> str:
        r = self.r
        if self.rare():
            return r.choice(_BAD_NUMBERS)
        pick = r.random()
        if pick < 0.5:
            return r.choice(_NUMBERS)
        if pick < 0.75:  # a random double, as Python writes it or with more digits
            x = struct.unpack("<d", r.getrandbits(64).to_bytes(8, "little"))[0]
            x = x if math.isfinite(x) else r.random()
            return repr(x) if r.random() < 0.5 else f"{x:.{r.randint(0, 22)}e}"
        digits = "".join(r.choice("0123456789") for _ in range(r.randint(1, 22))).lstrip("0")
        text = r.choice(["", "-"]) + (digits or "0")
        if r.random() < 0.5:
            text += "." + "".join(r.choice("0123456789") for _ in range(r.randint(1, 20)))
        if r.random() < 0.4:
            text += r.choice("eE") + r.choice(["", "+", "-"]) + str(r.randint(0, 420))
        return text

    def string(self) -> str:
        r = self.r
        parts = []
        for _ in range(r.randint(0, 6)):
            if self.rare(0.05):
                parts.append(r.choice(_RARE_STRING_PIECES))
            else:
                parts.append(r.choice(_STRING_PIECES))
        return '"' + "".join(parts) + '"'

    def value(self, depth: int) -> str:
        r = self.r
        pick = r.random() * (0.9 if self.deep else 1.0)
        if depth > 0 and pick < 0.35:
            items = [self.value(depth - 1) for _ in range(r.randint(0, 3))]
            sep = self.space() + "," + self.space()
            trailing = "," if self.rare() else ""
            return "[" + self.space() + sep.join(items) + trailing + self.space() + "]"
        if depth > 0 and pick < 0.7:
            count = r.randint(0, 3)
            keys = [self.string() for _ in range(count)]
            if keys and r.random() < 0.15:
                keys.append(keys[0])  # a duplicate key: the last value wins, at the first place
            pairs = [
                k
                + self.space()
                + (";" if self.rare() else ":")
                + self.space()
                + self.value(depth - 1)
                for k in keys
            ]
            return "{" + self.space() + ("," + self.space()).join(pairs) + self.space() + "}"
        if pick < 0.8:
            return self.number()
        if pick < 0.9:
            return self.string()
        if self.rare():
            return r.choice(_BAD_CONSTANTS)
        return r.choice(_CONSTANTS)

    def body(self) -> bytes:
        """A JSON text as bytes, sometimes damaged (a BOM, cut short, a stray byte...)."""
        r = self.r
        text = self.space() + self.value(r.randint(0, 6)) + self.space()
        if self.rare(0.3) and text:
            cut = r.randrange(len(text) + 1)
            if r.random() < 0.5:
                text = text[:cut]
            else:
                text = text[:cut] + r.choice(["}", "]", ",", "x", '"', "\\", "\ud800"]) + text[cut:]
        raw = text.encode("utf-8", "surrogatepass")  # raw surrogates: bytes that are not UTF-8
        if self.rare(0.15):
            raw = b"\xef\xbb\xbf" + raw
        if self.rare(0.1):
            cut = r.randrange(len(raw) + 1)
            raw = (
                raw[:cut]
                + r.choice([b"\xff", b"\xc0\x80", b"\x80", b"\xe6\x97", b"\x00"])
                + raw[cut:]
            )
        return raw


def generated(count: int, offset: int = 0) -> Iterator[bytes]:
    for seed in range(offset, offset + count):
        yield _Gen(seed).body()


def _nested(depth: int, inner: bytes = b"1", *, objects: bool = False) -> bytes:
    if objects:
        return b'{"a":' * depth + inner + b"}" * depth
    return b"[" * depth + inner + b"]" * depth


_HAND_PICKED = [
    b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}',
    b"", b" ", b"null", b"1", b'"x"', b"[]", b"{}", b"-0", b"[-0, -0.0, 0e5, 1E2]",
    b'{"a": 1, "a": 2}', b'{"a": 1, "b": 2, "a": 3}',
    b"\xef\xbb\xbf{}", b"\xef\xbb\xbf", b'"\xed\xa0\x80"', b'"\xff"', b"\xff\xfe{\x00}\x00",
    b'{"n": 12345678901234567890}', b'{"n": 1234567890123456789}', b'{"n": 123456789012345678}',
    b'{"s": "1234567890123456789"}', b'{"n": -9223372036854775809}', b"[1e400]", b"[1e-400]",
    b'{"a": NaN}', b'{"a": Infinity}', b'{"a": -Infinity}', b"NaN", b"[1,]", b'{"a":1,}',
    b'"\\ud800"', b'"\\udc00"', b'{"\\ud800": 1}', b'"\\ud83d\\ude00"', b'"\\ud800\\u0041"',
    b'"\\\\ud800"', b'"caf\\u00e9"', b'"\x1f"', b'"\x7f"', b"\x0c1", b"1\x0c", b"1 2",
    b'{"seed": ' + b"9" * 5000 + b"}", b'{"a": 1e400, "b": "\\ud800"}',
    b'{"b": "\\ud800", "a": 1e400}', b'{"a": [[[[[1]]]]], "b": 1e400}',
    b'{"content": "' + b"{[" * 300 + b'"}',
]  # fmt: skip
_DEPTHS = (2, 4, 64, 512, 2000)


def _deep_cases() -> Iterator[tuple[bytes, int]]:
    for max_depth in (4, 64, 512):
        for depth in (max_depth - 1, max_depth, max_depth + 1):
            yield _nested(depth), max_depth
            yield _nested(depth, objects=True), max_depth
            yield _nested(depth, b'"\\ud800"'), max_depth
            yield _nested(depth, b"1e400"), max_depth
    for depth in (NESTING_SAFE - 1, NESTING_SAFE, NESTING_SAFE + 1, 900, 1000, 1024, 1025):
        for max_depth in (64, 512, 2000):
            yield _nested(depth), max_depth
            yield _nested(depth, objects=True), max_depth
    yield b"[" * 50_000 + b"]" * 50_000, 2000


# -------------------------------------------------------- the provider's json.loads


def _stdlib_inputs(body: bytes) -> Iterator[bytes | str]:
    yield body
    text: str | None
    try:
        text = body.decode("utf-8", "surrogatepass")  # SSE data may hold lone surrogates
    except UnicodeDecodeError:
        text = None
    if text is not None:
        yield text  # SSE data arrives as str
        if text.isascii():
            yield text.encode("utf-16")  # json.loads(bytes) reads UTF-16 and UTF-32 too
            yield text.encode("utf-32-le")


@pytest.mark.parametrize("offset", range(0, 400, 50))
def test_loads_answers_as_json_loads_for_generated_inputs(offset: int) -> None:
    for body in generated(50, offset):
        for data in _stdlib_inputs(body):
            assert outcome(lambda d=data: loads(d)) == outcome(lambda d=data: json.loads(d)), data


@pytest.mark.parametrize("body", _HAND_PICKED + [body for body, _ in _deep_cases()])
def test_loads_answers_as_json_loads_for_hand_picked_inputs(body: bytes) -> None:
    for data in _stdlib_inputs(body):
        assert outcome(lambda d=data: loads(d)) == outcome(lambda d=data: json.loads(d))


@pytest.mark.parametrize("data", [bytearray(b'{"a": 1}'), memoryview(b"[1]"), None, 1])
def test_loads_answers_as_json_loads_for_other_types(data: Any) -> None:
    assert outcome(lambda: loads(data)) == outcome(lambda: json.loads(data))


def test_loads_exact_vouches_only_for_what_the_stdlib_reads_alike() -> None:
    assert loads_counted(b'{"a": [1, {"b": "[{"}]}') == ({"a": [1, {"b": "[{"}]}, 5)
    assert loads_exact(b"18446744073709551616") is UNKNOWN  # a float in orjson
    assert loads_exact(b'"12345678901234567890"') is UNKNOWN  # needlessly, but cheaply
    assert loads_exact(b'"\\ud800"') is UNKNOWN
    assert loads_exact(b"[NaN]") is UNKNOWN
    assert loads_exact(b"\xef\xbb\xbf[]") is UNKNOWN
    assert loads_exact(_nested(NESTING_SAFE - 1)) == json.loads(_nested(NESTING_SAFE - 1))
    assert loads_exact(_nested(NESTING_SAFE)) is UNKNOWN
    assert loads_counted(_nested(NESTING_SAFE))[0] is UNKNOWN
    # Many brackets but shallow nesting: still orjson's.
    wide = b"[" + b",".join([b"[[]]"] * NESTING_SAFE) + b"]"
    assert loads_exact(wide) == json.loads(wide)


# ------------------------------------------------------------------------- encoders


class _Colour(enum.Enum):
    RED = 1


class _Size(enum.IntEnum):
    BIG = 3


class _Mode(str, enum.Enum):
    FAST = "fast"


class _Text(str):
    pass


class _Count(int):
    pass


class _Dict(dict[str, Any]):
    pass


@dataclasses.dataclass
class _Point:
    x: int


class _Model(pydantic.BaseModel):
    name: str
    when: datetime.datetime | None = None


_STRINGS = ["", "hi", "caf\u00e9", "\U0001f600", '"quoted"', "back\\slash", "\x00\x1f\x7f",
            "line\nbreak\ttab\r\b\f", "\u2028\u2029", "\ufeff", "</script>",
            "1234567890123456789"]  # fmt: skip
_INTS = [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1]
_FLOATS = [0.0, -0.0, 0.1, 0.7, 1.5, 1e16, 1e-5, 1e-7, 1e22, 1e300, 5e-324, 2.2250738585072014e-308,
           1.7976931348623157e308, 123456789.12345679, -3.5e-12]  # fmt: skip
_ODD = [
    math.nan, math.inf, -math.inf, 2**64, -(2**63) - 1, 10**30, "\ud800", "a\udfffb",
    _Colour.RED, _Size.BIG, _Mode.FAST, uuid.UUID(int=7), datetime.datetime(2024, 5, 1, 12, 0),
    datetime.date(2024, 5, 1), _Point(1), _Text("sub"), _Count(5), _Dict(a=1), {1: "int key"},
    {None: 1}, {True: 1}, {1.5: 1}, {_Text("k"): 1}, {_Mode.FAST: 1}, {(1, 2): 1}, {"s"},
    b"bytes", _Model(name="m"), _Model(name="m", when=datetime.datetime(2024, 5, 1)), object(),
]  # fmt: skip


def _python_value(r: random.Random, depth: int, odd: bool) -> Any:
    pick = r.random()
    if depth > 0 and pick < 0.25:
        return [_python_value(r, depth - 1, odd) for _ in range(r.randint(0, 4))]
    if depth > 0 and pick < 0.32:
        return tuple(_python_value(r, depth - 1, odd) for _ in range(r.randint(0, 3)))
    if depth > 0 and pick < 0.55:
        return {
            r.choice(_STRINGS) + str(n): _python_value(r, depth - 1, odd)
            for n in range(r.randint(0, 4))
        }
    if odd and pick < 0.62:
        return r.choice(_ODD)
    if pick < 0.72:
        return r.choice(_STRINGS)
    if pick < 0.82:
        return r.choice(_INTS) * r.choice([1, -1])
    if pick < 0.9:
        return r.choice(_FLOATS) * r.choice([1, -1])
    return r.choice([True, False, None])


def python_values(count: int, offset: int) -> Iterator[Any]:
    for seed in range(offset, offset + count):
        r = random.Random(seed)
        yield _python_value(r, r.randint(0, 5), odd=seed % 3 == 0)


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, dict):
        return any(_has_float(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_has_float(item) for item in value)
    return False


def _cycle() -> list[Any]:
    loop: list[Any] = [1]
    loop.append({"again": loop})
    return loop


_ENCODER_CASES = [
    *_ODD,
    {"usage": {"prompt_tokens": math.nan, "completion_tokens": 3}},
    [1, [2, [3, math.inf]]],
    _cycle(),
    [[[[[[1]]]]]],
    [[[]]] * 3,
    {"deep": json.loads(_nested(300))},  # deeper than orjson writes
    {"k": (1, (2.5, "x"))},
]


@pytest.fixture
async def client() -> AsyncIterator[OpenAIChatClient]:
    provider = OpenAIChatClient("m", base_url="http://127.0.0.1:9/v1", api_key="sk-test")
    yield provider
    await provider.aclose()


async def test_upstream_encoding_matches_the_stdlib_byte_for_byte_without_floats(
    client: OpenAIChatClient,
) -> None:
    for value in python_values(300, 0):
        body = {"model": "m", "extra": value}
        new = outcome(lambda b=body: client._encode(b))
        old = outcome(lambda b=body: reference_upstream(b))
        if old[0] == "value" and _has_float(value):
            # Floats may be spelled differently (1e-05 and 0.00001), never valued so.
            assert decoded(lambda b=body: client._encode(b)) == decoded(
                lambda b=body: reference_upstream(b)
            ), value
        else:
            assert new == old, value


@pytest.mark.parametrize("value", _ENCODER_CASES, ids=range(len(_ENCODER_CASES)))
async def test_upstream_encoding_answers_as_the_stdlib_for_odd_values(
    client: OpenAIChatClient, value: Any
) -> None:
    body = {"model": "m", "x": value}
    assert outcome(lambda: client._encode(body)) == outcome(lambda: reference_upstream(body))


async def test_upstream_encoding_still_refuses_nan(client: OpenAIChatClient) -> None:
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        client._encode({"model": "m", "temperature": math.nan})


def test_dumps_plain_leaves_what_orjson_would_change_to_the_stdlib() -> None:
    assert dumps_plain({"a": [1, 2.5, None, True, "x"]}) == b'{"a":[1,2.5,null,true,"x"]}'
    odd = [math.nan, [math.inf], _Colour.RED, uuid.UUID(int=1), _Point(1), _Text("x"), _Dict()]
    odd += [{1: 2}, 2**64, "\ud800", _cycle(), datetime.date(2024, 1, 1), (1, math.nan)]
    for value in odd:
        assert dumps_plain(value) is None, value


def test_the_helper_imports_without_the_server_stack() -> None:
    with open(_json.__file__, encoding="utf-8") as file:
        source = file.read()
    imported = set(re.findall(r"^(?:from|import) (\w+)", source, re.MULTILINE))
    assert imported <= {"__future__", "json", "typing", "orjson"}


# Answers and chunks whose values the encoders check themselves skip `_dumps`'s walk; what
# they write must be what the walk would have let through or sent to the stdlib.
