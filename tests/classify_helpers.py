"""Shared by the classify tests: a small routing config, input rows in every format, readers."""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

CONFIG: dict[str, Any] = {
    "routing": {"top_k": 3, "threshold": 0.25, "default_route": "general"},
    "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
    "routes": {
        "code": {
            "utterances": [
                "fix this bug in my python code",
                "write a function that sorts a list",
                "why does my program crash with an exception",
            ],
            "targets": ["p"],
        },
        "math": {
            "utterances": [
                "solve this equation for x",
                "compute the integral of x squared",
                "what is the derivative of sine",
            ],
            "targets": ["p"],
        },
        "general": {"utterances": ["hello, how are you"], "targets": ["p"]},
    },
}

_SUBJECTS = ["my python script", "this equation", "the integral", "my friend", "the compiler"]
_VERBS = ["crashes on", "needs help with", "is about", "keeps failing at", "asks about"]
_OBJECTS = ["a sorted list", "x squared", "the weather", "an exception", "the derivative"]


def sentences(count: int, seed: int = 7) -> list[str]:
    """`count` varied English sentences (mostly distinct), reproducible from `seed`."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.randint(0, 999)}"
        for _ in range(count)
    ]


def write_rows(path: Path, rows: list[dict[str, Any]], fmt: str) -> None:
    """Rows (dicts with the same keys) as JSONL, CSV or Parquet."""
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        path.write_text(buffer.getvalue(), encoding="utf-8")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


def read_rows(path: Path, fmt: str) -> list[dict[str, Any]]:
    """An output (a file or a folder of part files) as dicts, in line order."""
    files = sorted(p for p in path.iterdir() if p.name[0] not in "._") if path.is_dir() else [path]
    rows: list[dict[str, Any]] = []
    for file in files:
        if fmt == "jsonl":
            rows += [json.loads(line) for line in file.read_text().splitlines()]
        elif fmt == "csv":
            rows += pacsv.read_csv(file).to_pylist()
        else:
            rows += pq.read_table(file).to_pylist()
    return sorted(rows, key=lambda r: r["line"])
