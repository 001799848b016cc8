"""Output writers for `chatroute classify`: a file, a folder of part files, or stdout."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from chatroute.cli.classify_layout import Layout, Result
from chatroute.cli.classify_read import RowBatch
from chatroute.cli.classify_summary import Summary

__all__ = ["OutputSpec", "ResultWriter", "ResumeError", "open_writer", "scan_output"]

_EXT = {"jsonl": ".jsonl", "csv": ".csv", "parquet": ".parquet"}
_READ_EXT = {"jsonl": (".jsonl", ".json"), "csv": (".csv",), "parquet": (".parquet",)}
_IN_PROGRESS = ".inprogress"


class ResumeError(ValueError):
    """An existing output that cannot be continued as it is."""


@dataclass(frozen=True)
class OutputSpec:
    """Where the results go: `target` ('-' for stdout), format, whether a folder of parts."""

    target: str
    fmt: str
    folder: bool
    part_rows: int = 20_000

    @property
    def stdout(self) -> bool:
        return self.target == "-"

    @property
    def path(self) -> Path:
        return Path(self.target)

    def parts(self) -> list[Path]:
        """The complete part files of a folder output, in order (names from `_` or `.`
        are not data: manifests and parts still being written)."""
        if not self.path.is_dir():
            return []
        return sorted(
            p
            for p in self.path.iterdir()
            if p.is_file() and p.suffix in _READ_EXT[self.fmt] and p.name[0] not in "._"
        )


class _Stream:
    """One format written to one open binary stream."""

    def __init__(self, fh: IO[bytes], fmt: str, layout: Layout, *, header: bool) -> None:
        self.fh = fh
        self.fmt = fmt
        self.layout = layout
        self._arrow: Any = None
        if fmt == "csv":
            import pyarrow.csv as pacsv

            self._arrow = pacsv.CSVWriter(
                fh, layout.schema(), write_options=pacsv.WriteOptions(include_header=header)
            )
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            self._arrow = pq.ParquetWriter(fh, layout.schema(), compression="zstd")

    def write(self, batch: RowBatch, results: Sequence[Result]) -> None:
        if self.fmt == "jsonl":
            self.fh.write(self.layout.lines(batch, results))
        else:
            self._arrow.write_table(self.layout.table(batch, results))

    def close(self) -> None:
        if self._arrow is not None:
            self._arrow.close()


class ResultWriter:
    """Writes result batches in input order; `close()` makes what was written complete.

    A JSONL or CSV file is appended to and synced after every batch (an interrupted run
    keeps every batch written). A folder gets part files of `part_rows` rows, each written
    under a hidden name and renamed when complete (`close()` completes the last one, also
    after an interruption). A single Parquet file is complete only after `close()`.
    """

    def __init__(self, spec: OutputSpec, layout: Layout, *, next_part: int = 0) -> None:
        self.spec = spec
        self.layout = layout
        self.rows = 0
        self._part = next_part
        self._part_rows = 0
        self._file: IO[bytes] | None = None
        self._stream: _Stream | None = None
        self._pending: Path | None = None  # the in-progress name of what is being written
        self._final: Path | None = None
        if spec.stdout:
            self._stream = _Stream(sys.stdout.buffer, spec.fmt, layout, header=True)
        elif not spec.folder:
            if spec.fmt == "parquet":
                self._pending = spec.path.with_name(spec.path.name + _IN_PROGRESS)
                self._final = spec.path
                self._file = open(self._pending, "wb")  # noqa: SIM115 - closed in close()
                self._stream = _Stream(self._file, spec.fmt, layout, header=True)
            else:
                header = not spec.path.exists() or spec.path.stat().st_size == 0
                self._file = open(spec.path, "ab")  # noqa: SIM115 - closed in close()
                self._stream = _Stream(self._file, spec.fmt, layout, header=header)
        else:
            spec.path.mkdir(parents=True, exist_ok=True)

    def _open_part(self) -> _Stream:
        name = f"part-{self._part:05d}{_EXT[self.spec.fmt]}"
        self._final = self.spec.path / name
        self._pending = self.spec.path / f".{name}{_IN_PROGRESS}"
        self._file = open(self._pending, "wb")  # noqa: SIM115 - closed in _close_part()
        self._stream = _Stream(self._file, self.spec.fmt, self.layout, header=True)
        self._part_rows = 0
        return self._stream

    def _close_part(self) -> None:
        if self._stream is None or self._file is None:
            return
        self._stream.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if self._pending is not None and self._final is not None:
            os.replace(self._pending, self._final)
        self._stream = self._file = self._pending = None
        self._part += 1

    def write(self, batch: RowBatch, results: Sequence[Result]) -> None:
        """Write one batch's rows (none is fine: nothing happens)."""
        if not results:
            return
        if self.spec.folder:
            stream = self._stream or self._open_part()
            stream.write(batch, results)
            self._part_rows += len(results)
            if self._part_rows >= self.spec.part_rows:
                self._close_part()
        else:
            assert self._stream is not None
            self._stream.write(batch, results)
            if self.spec.stdout:
                sys.stdout.buffer.flush()
            elif self.spec.fmt != "parquet" and self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
        self.rows += len(results)

    def close(self) -> None:
        """Complete the output (the last part, the Parquet file's footer)."""
        if self.spec.folder:
            self._close_part()
            return
        if self._stream is not None:
            self._stream.close()
        if self._file is not None:
            self._file.close()
            if self._pending is not None and self._final is not None:
                os.replace(self._pending, self._final)
        elif self.spec.stdout:
            sys.stdout.buffer.flush()


def open_writer(spec: OutputSpec, layout: Layout, *, next_part: int = 0) -> ResultWriter:
    """A writer for `spec`; parts are numbered from `next_part` (after those kept)."""
    return ResultWriter(spec, layout, next_part=next_part)


def _cut_partial_line(path: Path) -> None:
    """Cut an interrupted write's trailing partial line off a JSONL or CSV file."""
    with open(path, "rb+") as fh:
        size = fh.seek(0, os.SEEK_END)
        position = size
        while position > 0:
            step = min(1 << 16, position)
            fh.seek(position - step)
            chunk = fh.read(step)
            found = chunk.rfind(b"\n")
            if found >= 0:
                end = position - step + found + 1
                if end != size:
                    fh.truncate(end)
                return
            position -= step
        fh.truncate(0)


_SCAN = ("line", "route", "score", "is_default")


def _tables(path: Path, fmt: str) -> Iterator[Any]:
    """The scanned columns of one output file, as Arrow tables or record batches."""
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=65_536, columns=list(_SCAN))
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        reader = pacsv.open_csv(
            path,
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                include_columns=list(_SCAN),
                column_types={
                    "line": pa.int64(),
                    "route": pa.string(),
                    "score": pa.float64(),
                    "is_default": pa.bool_(),
                },
            ),
        )
        yield from reader
    else:
        columns: dict[str, list[Any]] = {name: [] for name in _SCAN}
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    record = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(record, dict) or not isinstance(record.get("line"), int):
                    continue
                for name in _SCAN:
                    columns[name].append(record.get(name))
                if len(columns["line"]) >= 65_536:
                    yield pa.table(columns)
                    columns = {name: [] for name in _SCAN}
        if columns["line"]:
            yield pa.table(columns)


def scan_output(spec: OutputSpec, routes: Sequence[str]) -> tuple[int, int, Summary]:
    """What an existing output holds: the last input row it reaches, the number of complete
    parts (folders), and the summary of its rows. In-progress parts are removed and a
    partial trailing line is cut off; ResumeError when the output cannot be read back."""
    summary = Summary(routes)
    last = 0
    files: list[Path]
    if spec.folder:
        for stray in spec.path.glob(f".*{_IN_PROGRESS}"):
            stray.unlink()
        files = spec.parts()
    else:
        if spec.fmt != "parquet":
            _cut_partial_line(spec.path)
        files = [spec.path]
    for path in files:
        try:
            for table in _tables(path, spec.fmt):
                data = table.to_pydict()
                if data["line"]:
                    last = max(last, max(data["line"]))
                summary.add_columns(data["route"], data["score"], data["is_default"])
        except Exception as exc:  # an Arrow or OS error: the output is not what we wrote
            raise ResumeError(f"cannot read back {path}: {exc}") from None
    summary.resumed = summary.total
    return last, len(files) if spec.folder else 0, summary
