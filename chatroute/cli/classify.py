"""Offline batch classification of a JSONL file of traffic, resumable, one decision per line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from chatroute.engine import Engine
from chatroute.server.errors import APIError
from chatroute.server.wire import WireMessage, query_text, to_chat_messages

__all__ = ["BadLine", "ClassifyReport", "classify_file", "parse_input_line", "resume_point"]

_MESSAGES = TypeAdapter(list[WireMessage])


@dataclass(frozen=True)
class BadLine:
    """An input line that could not be classified, and why."""

    line: int
    reason: str


@dataclass
class ClassifyReport:
    """What one run did: lines classified, lines skipped because already done, bad lines."""

    classified: int = 0
    resumed_after: int = 0
    bad: list[BadLine] = field(default_factory=list)


def parse_input_line(text: str) -> tuple[str, Any]:
    """The query text of one input line and its `id` (None when absent).

    A line is a JSON string, `{"input": "..."}` or `{"messages": [...]}` (the OpenAI
    message shape; the last user message is the query). Raises ValueError otherwise.
    """
    try:
        item = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if isinstance(item, str):
        return item, None
    if not isinstance(item, dict):
        raise ValueError("expected a JSON string or an object with 'input' or 'messages'")
    ident = item.get("id")
    if "input" in item:
        value = item["input"]
        if not isinstance(value, str):
            raise ValueError(f"'input' must be a string, got {type(value).__name__}")
        return value, ident
    if "messages" in item:
        try:
            wire = _MESSAGES.validate_python(item["messages"])
            return query_text(to_chat_messages(wire)), ident
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"bad messages ({where}: {first['msg']})") from None
        except APIError as exc:
            raise ValueError(f"bad messages ({exc.message})") from None
    raise ValueError("expected a JSON string or an object with 'input' or 'messages'")


def resume_point(output: Path) -> int:
    """The input line number the existing output reaches (0 when there is none).

    A trailing partial line (an interrupted write) is cut off the file first.
    """
    if not output.exists():
        return 0
    with open(output, "rb+") as fh:
        data = fh.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            fh.truncate(end)
    for raw in reversed(data[:end].splitlines()):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("line"), int):
            return int(record["line"])
    return 0


_Batch = list[tuple[int, Any, str]]


def _read_batches(
    source: Path,
    start_after: int,
    batch_size: int,
    report: ClassifyReport,
    on_progress: Callable[[int], None] | None,
    on_bad_line: Callable[[BadLine], None] | None,
) -> Generator[_Batch, None, None]:
    """Parsed batches of (line number, id, query) from the input, bad lines reported."""
    batch: _Batch = []
    with open(source, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if on_progress is not None:
                on_progress(len(raw))
            if number <= start_after:
                continue
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                query, ident = parse_input_line(text)
            except ValueError as exc:  # UnicodeDecodeError included
                reason = "not valid UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
                bad = BadLine(number, reason)
                report.bad.append(bad)
                if on_bad_line is not None:
                    on_bad_line(bad)
                continue
            batch.append((number, ident, query))
            if len(batch) >= batch_size:
                yield batch
                batch = []
    if batch:
        yield batch


def _append(output: Path, lines: list[bytes]) -> None:
    with open(output, "ab") as out:
        out.write(b"".join(lines))
        out.flush()
        os.fsync(out.fileno())


async def classify_file(
    engine: Engine,
    source: Path,
    output: Path,
    *,
    batch_size: int = 256,
    on_progress: Callable[[int], None] | None = None,
    on_bad_line: Callable[[BadLine], None] | None = None,
) -> ClassifyReport:
    """Classify every line of `source` into `output`, resuming after what `output` holds.

    Each batch of `batch_size` inputs is one `route_batch` call; its results are appended
    and flushed before the next batch, so an interrupted run loses at most one batch. The
    next batch is read and parsed in a thread while the current one is embedded. Output
    lines are `{"line", "id"?, "route", "score", "scores", "is_default"}`, in input order.
    `on_progress(n)` gets the bytes of input consumed; bad lines are reported, not fatal.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    report = ClassifyReport(resumed_after=await asyncio.to_thread(resume_point, output))
    batches = _read_batches(
        source, report.resumed_after, batch_size, report, on_progress, on_bad_line
    )
    reading = asyncio.ensure_future(asyncio.to_thread(next, batches, None))
    try:
        while (batch := await reading) is not None:
            reading = asyncio.ensure_future(asyncio.to_thread(next, batches, None))
            decisions = await engine.decide_batch([query for _, _, query in batch])
            lines = []
            for (number, ident, _), decision in zip(batch, decisions, strict=True):
                record: dict[str, Any] = {"line": number}
                if ident is not None:
                    record["id"] = ident
                record.update(engine.describe(decision))
                lines.append(json.dumps(record, ensure_ascii=False).encode() + b"\n")
            await asyncio.to_thread(_append, output, lines)
            report.classified += len(batch)
    finally:
        if not reading.done():
            with contextlib.suppress(Exception):
                await reading
        await asyncio.to_thread(batches.close)
    return report
