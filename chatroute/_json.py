"""orjson for the per-request JSON work, used only where it gives what the stdlib `json` gives."""

from __future__ import annotations

import json
from typing import Any, Final

import orjson

__all__ = [
    "NESTING_SAFE",
    "UNKNOWN",
    "dumps_checked",
    "dumps_plain",
    "loads",
    "loads_counted",
    "loads_exact",
]

# Where orjson and the stdlib can disagree, and what is done about it:
# - Integers beyond 64 bits become floats in orjson: a run of 19 digits anywhere (in a
#   string too) sends the input to the stdlib.
# - The stdlib parser raises RecursionError past Python's recursion limit, orjson only
#   past 1024 levels: nesting of NESTING_SAFE levels or more goes to the stdlib.
# - Everything else orjson treats differently (NaN / Infinity, numbers that overflow to
#   inf, lone surrogate escapes, a byte order mark, bytes that are not UTF-8, UTF-16 and
#   UTF-32 input) it refuses, and the stdlib then gives its own value or error.
# - Encoding: orjson writes NaN and inf as null and encodes Enum, UUID, dataclass and
#   datetime values the stdlib refuses, so its output is used only for values made of
#   dicts, lists, tuples, str, int, bool, None and finite floats (checked after encoding,
#   so that a cycle has already failed in orjson instead of looping the check).

NESTING_SAFE: Final = 256
"""Nesting below which the stdlib parser never meets the recursion limit (1000 levels
by default, less the depth of the caller's stack)."""


class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Final = _Unknown()
"""What `loads_exact` returns when orjson cannot vouch for the stdlib's answer."""

_SCAN: Final = bytes.maketrans(b"123456789{", b"000000000[")
_LONG_DIGITS: Final = b"0" * 19


def loads_exact(raw: bytes) -> Any:
    """`json.loads(raw)`'s value parsed by orjson, or `UNKNOWN` when orjson is not known to
    give the same (then the stdlib must parse it, for its value or its error).

    A value returned is one the stdlib gives too, with no `NaN` / `Infinity`, no float
    that overflowed to inf, and no unpaired surrogate in any string.
    """
    return loads_counted(raw)[0]


def loads_counted(raw: bytes) -> tuple[Any, int]:
    """`loads_exact(raw)`, and the count of `[` and `{` bytes in `raw` (a bound on the
    nesting, strings included)."""
    # Every digit becomes "0" and "{" becomes "[": one pass finds long digit runs and
    # counts the bytes that open arrays and objects.
    scanned = raw.translate(_SCAN)
    openers = scanned.count(b"[")
    if _LONG_DIGITS in scanned:
        return UNKNOWN, openers
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return UNKNOWN, openers
    if openers >= NESTING_SAFE and _nests_at_least(value, NESTING_SAFE):
        return UNKNOWN, openers
    return value, openers


def loads(data: bytes | str) -> Any:
    """`json.loads(data)`: the same value, or the same exception."""
    if isinstance(data, str):
        try:
            raw = data.encode()
        except UnicodeEncodeError:  # lone surrogates: orjson refuses them anyway
            return json.loads(data)
    elif isinstance(data, bytes):
        raw = data
    else:  # a bytearray, or something json.loads refuses
        return json.loads(data)
    value = loads_exact(raw)
    if value is UNKNOWN:
        return json.loads(data)
    return value


def dumps_plain(obj: Any) -> bytes | None:
    """orjson's compact UTF-8 encoding of `obj` when `obj` holds only dicts (str keys),
    lists, tuples, str, int, bool, None and finite floats, which is the JSON value the
    stdlib writes for it; None for anything else (let the stdlib encode it, or fail)."""
    try:
        out = orjson.dumps(obj)
    except orjson.JSONEncodeError:  # non-str keys, big ints, surrogates, cycles, unknown types
        return None
    return out if _plain(obj) else None


def dumps_checked(obj: Any) -> bytes | None:
    """`dumps_plain(obj)` for a value its caller has already checked holds only the plain
    types that function allows (no float, or only finite ones), without walking it again:
    orjson's encoding, or None when orjson refuses it (an integer beyond 64 bits)."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return None


def _plain(obj: Any) -> bool:
    stack = [obj]
    pop = stack.pop
    while stack:
        value = pop()
        kind = type(value)
        if kind is str or kind is int or value is None or kind is bool:
            continue
        if kind is dict:
            stack.extend(value.values())
        elif kind is list or kind is tuple:
            stack.extend(value)
        elif kind is float:
            if value - value != 0.0:  # NaN or +-inf
                return False
        else:
            return False
    return True


def _nests_at_least(value: Any, levels: int) -> bool:
    """Whether arrays and objects in `value` (as orjson makes them) nest `levels` deep."""
    if type(value) is not dict and type(value) is not list:
        return False
    if levels <= 1:
        return True
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        for child in item.values() if type(item) is dict else item:
            kind = type(child)
            if kind is dict or kind is list:
                if depth + 1 >= levels:
                    return True
                stack.append((child, depth + 1))
    return False
