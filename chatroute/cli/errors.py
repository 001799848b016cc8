"""A user's error on the command line: one line per problem and exit 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

from chatroute.checks import PathError
from chatroute.config import ConfigError

__all__ = ["UserErrorGroup", "describe_user_error", "is_user_error", "report"]

# OSErrors that say a path the user gave is unusable (not found, a folder, not writable).
_PATH_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def _library_errors() -> tuple[type[BaseException], ...]:
    """The errors of the embedder and the profile index that come from what the user gave."""
    from chatroute.embedder.errors import EmbedderLoadError
    from chatroute.index.errors import FingerprintMismatchError, IndexFormatError

    return (EmbedderLoadError, FingerprintMismatchError, IndexFormatError)


def is_user_error(exc: BaseException) -> bool:
    """Whether `exc` reports a problem with the user's config, paths or model (not a bug)."""
    if isinstance(exc, _PATH_ERRORS):
        return exc.filename is not None
    return isinstance(exc, (ConfigError, PathError, *_library_errors()))


def describe_user_error(exc: BaseException) -> list[str]:
    """The lines that report a user's error: one per problem, each naming what is at fault."""
    if isinstance(exc, ConfigError):
        where = f"{exc.source}: " if exc.source else ""
        return [f"{where}{path or '<root>'}: {message}" for path, message in exc.problems]
    if isinstance(exc, OSError) and exc.filename is not None:
        return [f"{exc.filename}: {exc.strerror or exc}"]
    return [" ".join(str(exc).split()) or type(exc).__name__]


def report(exc: BaseException) -> None:
    """Print `describe_user_error(exc)` on stderr, each line starting with `error:`."""
    for line in describe_user_error(exc):
        print(f"error: {line}", file=sys.stderr)


class UserErrorGroup(TyperGroup):
    """The command group that turns a user's error raised by any command into exit 2.

    Everything else (a bug) propagates with its traceback.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if not is_user_error(exc):
                raise
            report(exc)
            raise typer.Exit(2) from None
