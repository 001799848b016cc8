"""Input readers for `chatroute classify`: JSONL, CSV and Parquet rows in bounded batches."""

from __future__ import annotations

import csv
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import IO, Any

import orjson

from chatroute.cli.classify import BadLine, messages_query

__all__ = [
    "FORMATS",
    "Fields",
    "InputError",
    "Reader",
    "RowBatch",
    "detect_format",
    "open_input",
    "open_stream",
]

FORMATS = ("jsonl", "csv", "parquet")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}


class InputError(ValueError):
    """The input as a whole cannot be read as asked: a missing column, a wrong column type."""


def detect_format(name: str, given: str | None, *, option: str = "--format") -> str:
    """The format `given`, else the one `name`'s extension says; InputError when neither."""
    if given is not None:
        return given
    if name == "-":
        return "jsonl"
    found = _EXTENSIONS.get(PurePosixPath(name.rstrip("/")).suffix.lower())
    if found is None:
        raise InputError(
            f"cannot tell the format of {name} from its name; give {option} jsonl, csv or parquet"
        )
    return found


@dataclass(frozen=True)
class Fields:
    """Which columns hold the text, the conversation, the id, and what else to carry."""

    text: str | None = None  # None: "input" when present
    messages: str | None = None  # None: "messages" when present
    id: str | None = None  # None: "id" when present
    keep: tuple[str, ...] = ()


@dataclass
class RowBatch:
    """Consecutive input rows: the usable ones (numbers, texts, ids, kept values) and the bad."""

    lines: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    keep: dict[str, list[Any]] = field(default_factory=dict)
    bad: list[BadLine] = field(default_factory=list)
    last: int = 0  # the highest row number this batch consumed
    position: int = 0  # bytes (JSONL, CSV) or rows (Parquet) of the input consumed so far

    def __len__(self) -> int:
        return len(self.lines)


class Reader:
    """One input: its format, columns, size, and its rows in batches.

    `id_type` / `keep_types` give the Arrow type of the id and kept columns (None: JSON
    values, written as text to CSV and Parquet); `has_id` says whether rows carry an id.
    `total` is the input's size in the unit of `RowBatch.position` (None when unknown).
    """

    fmt = ""
    unit = "bytes"

    def __init__(self, source: str, fields: Fields) -> None:
        self.source = source
        self.fields = fields
        self.has_id = False
        self.id_type: Any = None
        self.keep_types: dict[str, Any] = {}
        self.total: int | None = None
        self.owned: list[IO[bytes]] = []

    def where(self, number: int) -> str:
        """How a row is named in messages: `file:line` for JSONL, `file: row N` otherwise."""
        return f"{self.source}: row {number}"

    def batches(self, size: int, skip_through: int = 0) -> Iterator[RowBatch]:
        raise NotImplementedError

    def close(self) -> None:
        """Close the files the reader was given to own."""
        for fh in self.owned:
            fh.close()


def _new_batch(keep: tuple[str, ...]) -> RowBatch:
    return RowBatch(keep={name: [] for name in keep})


def _found(names: list[str]) -> str:
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    return shown or "none"


class _JsonlReader(Reader):
    fmt = "jsonl"

    def __init__(self, fh: IO[bytes], source: str, fields: Fields, total: int | None) -> None:
        super().__init__(source, fields)
        self._fh = fh
        self.total = total
        self.has_id = True
        self._text = fields.text or "input"
        self._messages = fields.messages or "messages"
        self._id = fields.id or "id"
        self.keep_types = dict.fromkeys(fields.keep)

    def where(self, number: int) -> str:
        return f"{self.source}:{number}"

    def _row(self, raw: bytes) -> tuple[str, Any, list[Any]]:
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("not valid UTF-8") from None
            raise ValueError(f"not valid JSON ({exc})") from None
        keep = self.fields.keep
        if isinstance(item, str):
            return item, None, [None] * len(keep)
        if not isinstance(item, dict):
            raise ValueError(f"expected a JSON string or object, got {type(item).__name__}")
        if self._text in item:
            value = item[self._text]
            if value is None:
                value = ""
            elif not isinstance(value, str):
                raise ValueError(f"'{self._text}' must be a string, got {type(value).__name__}")
        elif self._messages in item:
            value = messages_query(item[self._messages])
        else:
            raise ValueError(
                f"no '{self._text}' or '{self._messages}' field (fields: {_found(list(item))})"
            )
        return value, item.get(self._id), [item.get(name) for name in keep]

    def batches(self, size: int, skip_through: int = 0) -> Iterator[RowBatch]:
        batch = _new_batch(self.fields.keep)
        position = 0
        for number, raw in enumerate(self._fh, start=1):
            position += len(raw)
            if number <= skip_through:
                continue
            batch.last = number
            batch.position = position
            if not raw.strip():
                continue
            try:
                text, ident, kept = self._row(raw)
            except ValueError as exc:
                batch.bad.append(BadLine(number, str(exc)))
                continue
            batch.lines.append(number)
            batch.texts.append(text)
            batch.ids.append(ident)
            for name, value in zip(self.fields.keep, kept, strict=True):
                batch.keep[name].append(value)
            if len(batch.lines) >= size:
                yield batch
                batch = _new_batch(self.fields.keep)
        if batch.last:
            yield batch


def _resolve(names: list[str], fields: Fields, source: str) -> tuple[str | None, str | None]:
    """The text and messages columns to read (one of them is set) from the columns found."""
    for given in (fields.text, fields.messages, fields.id, *fields.keep):
        if given is not None and given not in names:
            raise InputError(f"{source} has no column '{given}' (columns found: {_found(names)})")
    if fields.text is not None or fields.messages is not None:
        return fields.text, fields.messages
    if "input" in names:
        return "input", None
    if "messages" in names:
        return None, "messages"
    raise InputError(
        f"{source} has no 'input' or 'messages' column (columns found: {_found(names)}); "
        "name the text column with --text-field"
    )


class _ColumnarReader(Reader):
    """Rows from Arrow record batches (CSV and Parquet): the shared per-row conversion."""

    def _setup(self, names: list[str]) -> None:
        self._text, self._messages = _resolve(names, self.fields, self.source)
        self._id = self.fields.id or ("id" if "id" in names else None)
        self.has_id = self._id is not None
        wanted = [self._text, self._messages, self._id, *self.fields.keep]
        self.columns = list(dict.fromkeys(name for name in wanted if name is not None))

    def _decode(self, value: Any) -> Any:
        return value

    def _take(self, table: Any, start: int, skip_through: int, batch: RowBatch) -> None:
        """Add the rows of one Arrow batch, numbered from `start`, to `batch`."""
        data = {name: table.column(name).to_pylist() for name in self.columns}
        texts = data[self._text] if self._text else data[self._messages or ""]
        keep = self.fields.keep
        for offset, raw in enumerate(texts):
            number = start + offset
            if number <= skip_through:
                continue
            batch.last = number
            try:
                value = self._decode(raw)
                if value is None:
                    text = ""
                elif self._text is not None:
                    if not isinstance(value, str):
                        raise ValueError(f"'{self._text}' is not text: {value!r:.40}")
                    text = value
                else:
                    text = messages_query(value)
                ident = self._decode(data[self._id][offset]) if self._id else None
                kept = [self._decode(data[name][offset]) for name in keep]
            except ValueError as exc:
                batch.bad.append(BadLine(number, str(exc)))
                continue
            batch.lines.append(number)
            batch.texts.append(text)
            batch.ids.append(ident)
            for name, item in zip(keep, kept, strict=True):
                batch.keep[name].append(item)


class _CsvReader(_ColumnarReader):
    fmt = "csv"

    def __init__(self, fh: IO[bytes], source: str, fields: Fields, total: int | None) -> None:
        import pyarrow as pa
        import pyarrow.csv as pacsv

        super().__init__(source, fields)
        self._fh = fh
        self.total = total
        header = fh.readline()
        try:
            line = header.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise InputError(f"{source}: the CSV header is not valid UTF-8") from None
        names = next(csv.reader([line]), [])
        if not names:
            raise InputError(f"{source} is empty: no CSV header")
        self._setup(names)
        self._header_bytes = len(header)
        self.id_type = pa.string()
        self.keep_types = dict.fromkeys(fields.keep, pa.string())
        # Every column is read as bytes: a row that is not UTF-8 is then one bad row, not a
        # failed read.
        self._reader = pacsv.open_csv(
            fh,
            read_options=pacsv.ReadOptions(column_names=names, block_size=1 << 20),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                column_types=dict.fromkeys(names, pa.binary()),
                include_columns=self.columns,
                strings_can_be_null=False,
                quoted_strings_can_be_null=False,
            ),
        )

    def _decode(self, value: Any) -> Any:
        if isinstance(value, bytes):
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("not valid UTF-8") from None
        return value

    def batches(self, size: int, skip_through: int = 0) -> Iterator[RowBatch]:
        import pyarrow as pa

        batch = _new_batch(self.fields.keep)
        start = 1
        while True:
            try:
                record = self._reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as exc:
                raise InputError(f"{self.source}: unreadable CSV after row {start - 1}: {exc}")
            try:
                position = self._fh.tell()
            except (OSError, ValueError):
                position = 0
            for piece in _pieces(record, size):
                self._take(piece, start, skip_through, batch)
                start += piece.num_rows
                batch.position = position
                if len(batch) >= size:
                    yield batch
                    batch = _new_batch(self.fields.keep)
        if batch.last:
            yield batch


def _pieces(record: Any, size: int) -> Iterator[Any]:
    """An Arrow record batch in slices of at most `size` rows (zero-copy)."""
    for offset in range(0, record.num_rows, size):
        yield record.slice(offset, size)


def _text_type(kind: Any) -> bool:
    import pyarrow as pa

    return bool(
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
    )


class _ParquetReader(_ColumnarReader):
    fmt = "parquet"
    unit = "rows"

    def __init__(self, fh: Any, source: str, fields: Fields) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        super().__init__(source, fields)
        try:
            self._file = pq.ParquetFile(fh)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{source} is not a readable Parquet file: {exc}") from None
        schema = self._file.schema_arrow
        self._setup(list(schema.names))
        if self._text is not None and not _text_type(schema.field(self._text).type):
            raise InputError(
                f"{source}: column '{self._text}' is {schema.field(self._text).type}, "
                "not text; name the text column with --text-field"
            )
        if self._messages is not None:
            kind = schema.field(self._messages).type
            if not (_text_type(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)):
                raise InputError(
                    f"{source}: column '{self._messages}' is {kind}, not a list of messages"
                )
        self.id_type = schema.field(self._id).type if self._id else None
        self.keep_types = {name: schema.field(name).type for name in fields.keep}
        self.total = self._file.metadata.num_rows

    def batches(self, size: int, skip_through: int = 0) -> Iterator[RowBatch]:
        metadata = self._file.metadata
        groups: list[int] = []
        start = 1
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if start + rows - 1 <= skip_through and not groups:
                start += rows  # a whole row group already done: not even read
                continue
            groups.append(group)
        position = start - 1
        if not groups:
            return
        batch = _new_batch(self.fields.keep)
        for record in self._file.iter_batches(
            batch_size=size, row_groups=groups, columns=self.columns
        ):
            self._take(record, start, skip_through, batch)
            start += record.num_rows
            position += record.num_rows
            batch.position = position
            if len(batch) >= size:
                yield batch
                batch = _new_batch(self.fields.keep)
        if batch.last:
            yield batch

    def close(self) -> None:
        self._file.close()
        super().close()


def open_stream(fh: IO[bytes], fmt: str, source: str, fields: Fields, size: int | None) -> Reader:
    """A reader over an open binary stream (seekable for Parquet) of the given format."""
    if fmt == "jsonl":
        return _JsonlReader(fh, source, fields, size)
    if fmt == "csv":
        return _CsvReader(fh, source, fields, size)
    return _ParquetReader(fh, source, fields)


def open_input(source: str, fmt: str, fields: Fields) -> Reader:
    """A reader over a file, or stdin for '-' (Parquet from stdin is first copied to a
    temporary file: the format needs random access). OSError when the file cannot be opened.
    """
    if source == "-":
        stdin = sys.stdin.buffer
        if fmt != "parquet":
            return open_stream(stdin, fmt, "<stdin>", fields, None)
        spool: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - the reader closes it
        shutil.copyfileobj(stdin, spool, 1 << 20)
        spool.seek(0)
        reader = open_stream(spool, fmt, "<stdin>", fields, None)
        reader.owned.append(spool)
        return reader
    fh = open(source, "rb", buffering=1 << 20)  # noqa: SIM115 - closed by the reader
    try:
        reader = open_stream(fh, fmt, source, fields, os.fstat(fh.fileno()).st_size)
        reader.owned.append(fh)
        return reader
    except BaseException:
        fh.close()
        raise
