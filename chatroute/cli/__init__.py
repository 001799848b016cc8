"""The `chatroute` command line (Typer): serve, route, classify, fit, index build."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatroute.cli.app import app, main

__all__ = ["app", "main"]


# The command line resolves on first use: a Ray worker that runs a piece of `classify`
# (chatroute.cli.classify_ray) imports that piece, not Typer, rich and every command.
def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'chatroute.cli' has no attribute {name!r}")
    value = getattr(importlib.import_module("chatroute.cli.app"), name)
    globals()[name] = value
    return value
