"""Calibration from a labelled JSONL file: fit per-route thresholds and save them for the config."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from chatroute.cli.classify import BadLine, parse_input_line
from chatroute.engine import Engine
from chatroute.router.calibration import CalibrationResult, ProfileOverlapWarning, calibrate
from chatroute.router.semantic import SemanticRoutingChatClient

__all__ = ["THRESHOLDS_FORMAT", "fit_file", "read_labelled", "thresholds_document"]

THRESHOLDS_FORMAT = "chatroute-thresholds/1"


def read_labelled(
    source: Path,
    routes: Mapping[str, object],
    on_bad_line: Callable[[BadLine], None] | None = None,
) -> list[tuple[str, str | None]]:
    """(query, route name or None) pairs from lines like `{"input": ..., "route": "code"}`.

    The text is given as for `classify` (`input`, `messages` or a bare string is not
    allowed here: it has no label). `route` null, "" or absent means "no route": the
    default route should answer. Unknown route names and malformed lines are reported.
    """
    examples: list[tuple[str, str | None]] = []
    with open(source, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                query, _ = parse_input_line(text)
                item = json.loads(text)
                if not isinstance(item, dict):
                    raise ValueError("a labelled line must be an object with a 'route' key")
                label = item.get("route")
                if label is not None and not isinstance(label, str):
                    raise ValueError(f"'route' must be a string or null, got {label!r}")
                if label and label not in routes:
                    raise ValueError(f"unknown route {label!r}")
                examples.append((query, label or None))
            except ValueError as exc:
                reason = "not valid UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
                if on_bad_line is not None:
                    on_bad_line(BadLine(number, reason))
    return examples


async def fit_file(
    engine: Engine,
    source: Path,
    *,
    no_route_share: float | None = 0.5,
    on_bad_line: Callable[[BadLine], None] | None = None,
) -> tuple[CalibrationResult, list[str]]:
    """Fit thresholds on a labelled file; returns the result and the calibration warnings."""
    router = engine.router
    if not isinstance(router, SemanticRoutingChatClient):
        raise ValueError("fitting thresholds needs the semantic routing policy")
    examples = read_labelled(source, engine.routes, on_bad_line)
    if not examples:
        raise ValueError(f"{source} holds no usable labelled examples")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileOverlapWarning)
        result = await calibrate(router, examples, engine.routes, no_route_share=no_route_share)
    return result, [str(w.message) for w in caught]


def thresholds_document(engine: Engine, result: CalibrationResult) -> dict[str, Any]:
    """The JSON document `routing.thresholds_file` reads: thresholds by route, and the report.

    `scoring` and `oos_score` say what the thresholds were fitted for: set
    `routing.oos_score` to that `oos_score` so that the service gates on the same score.
    """
    return {
        "format": THRESHOLDS_FORMAT,
        "scoring": result.report.scoring,
        "oos_score": result.oos_score,
        "thresholds": result.thresholds_by_name(engine.routes),
        "report": result.report.to_dict(),
    }
