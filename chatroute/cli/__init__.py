"""The `chatroute` command line (Typer): serve, route, classify, fit, index build."""

from chatroute.cli.app import app, main

__all__ = ["app", "main"]
