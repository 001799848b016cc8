"""The httpx flavour that the installed openai SDK speaks (httpx2 from openai 3.x, httpx before)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import openai

__all__ = ["OPENAI_MAJOR", "http"]

OPENAI_MAJOR = int(openai.__version__.split(".", 1)[0])

if TYPE_CHECKING:
    import httpx2 as http
else:
    http = importlib.import_module("httpx2" if OPENAI_MAJOR >= 3 else "httpx")
