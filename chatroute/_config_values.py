"""Checks of single config values: URLs, HTTP headers, and the keys a model accepts."""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable
from typing import Annotated, Any, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import AliasChoices, BaseModel

__all__ = ["did_you_mean", "header_problem", "key_hint", "url_problem"]

_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_HEADER_VALUE = re.compile(r"^[\t\x20-\x7e]*$")


def url_problem(url: str, schemes: tuple[str, ...] = ("http", "https")) -> str | None:
    """Why `url` is no usable absolute URL with one of `schemes`, or None when it is."""
    shown = " or ".join(f"{s}://" for s in schemes)
    if not url or url != url.strip() or any(c in url for c in "\r\n\t "):
        return f"{url!r} is not a URL (empty, or holds whitespace)"
    if "://" not in url:
        return f"{url!r} has no scheme: write it as {schemes[0]}://{url}"
    parts = urlsplit(url)
    if parts.scheme.lower() not in schemes:
        return f"{url!r} has the scheme {parts.scheme!r}; expected {shown}"
    try:
        host, _ = parts.hostname, parts.port
    except ValueError as exc:  # a port that is no number, or out of range
        return f"{url!r} has a bad port ({exc})"
    if not host and parts.scheme.lower() != "unix":
        return f"{url!r} names no host"
    return None


def header_problem(name: str, value: str) -> str | None:
    """Why a header name or value cannot be sent on HTTP/1.1, or None when it can."""
    if not _TOKEN.match(name):
        return f"header name {name!r} is not a valid HTTP token"
    if any(c in value for c in "\r\n\x00"):
        return f"header {name!r}: the value holds a line break or NUL (CR/LF injection)"
    if not _HEADER_VALUE.match(value):
        return f"header {name!r}: the value holds control or non-ASCII characters"
    return None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """A hint naming the known name closest to `name`, as " (did you mean 'X'?)"; "" when
    none is close."""
    match = _closest(name, known)
    return f" (did you mean {match!r}?)" if match is not None else ""


def key_hint(root: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """For the unknown key at `loc`: " (did you mean 'X'?)" naming the closest key `root`
    accepts in its place, or one a block inside it accepts ('timeouts.first_token' for a
    provider's 'first_token_timeout'); "" when none is close."""
    kind = _model_at(root, loc[:-1]) if loc else None
    if kind is None:
        return ""
    key = str(loc[-1])
    match = _closest(key, _keys_of(kind))
    if match is None:
        nested: dict[str, str] = {}  # a key of an inner block -> its path from here
        for name, field in kind.model_fields.items():
            inner = _unwrap(field.annotation)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                for sub in _keys_of(inner):
                    nested.setdefault(sub, f"{field.alias or name}.{sub}")
        found = _closest(key, nested)
        match = nested[found] if found is not None else None
    return f" (did you mean {match!r}?)" if match is not None else ""


def _closest(name: str, known: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(name, list(known), n=1)
    return found[0] if found else None


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model that holds the keys at `loc` (None when `loc` leads elsewhere)."""
    kind: Any = root
    skip = False  # the next part of `loc` is a key of a dict (a provider's name, ...)
    for part in loc:
        if skip:
            skip = False
            continue
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
        field = kind.model_fields.get(str(part))
        if field is None:
            field = next(
                (f for f in kind.model_fields.values() if f.alias == part),
                None,
            )
        if field is None:
            return None
        kind = _unwrap(field.annotation)
        if get_origin(kind) is dict:
            kind = _unwrap(get_args(kind)[1])
            skip = True
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def _keys_of(kind: type[BaseModel]) -> dict[str, None]:
    names: dict[str, None] = {}
    for field_name, field in kind.model_fields.items():
        names[field_name] = None
        if field.alias:
            names[field.alias] = None
        if isinstance(field.validation_alias, AliasChoices):
            names.update((str(c), None) for c in field.validation_alias.choices)
    return names


def _unwrap(annotation: Any) -> Any:
    """The type inside `X | None` and `Annotated[X, ...]`."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin is Union or origin is types.UnionType:
            args = [a for a in get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation
