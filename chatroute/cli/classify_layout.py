"""The rows `chatroute classify` writes: one decision per input row, as JSON lines or Arrow."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from chatroute.cli.classify_read import Reader, RowBatch
from chatroute.router.decision import RouteDecision

__all__ = ["OUTPUT_COLUMNS", "Layout", "Result", "results_of"]

# The columns every output row has, before the optional ones (id, per-route scores, kept).
OUTPUT_COLUMNS = ("line", "id", "route", "score", "is_default", "scoring")


@dataclass(frozen=True, slots=True)
class Result:
    """One row's decision as written: route name, score, default flag, scoring mode, scores."""

    route: str
    score: float | None
    is_default: bool
    scoring: str
    scores: dict[str, float] = field(default_factory=dict)


def results_of(
    decisions: Sequence[RouteDecision],
    route_name: Callable[[Any], str],
    scoring: str,
    *,
    with_scores: bool,
) -> list[Result]:
    """The written form of decisions; `route_name` maps a decision's client to its route."""
    out: list[Result] = []
    for decision in decisions:
        scores = (
            {route_name(client): value for client, value in decision.scores.items()}
            if with_scores
            else {}
        )
        out.append(
            Result(
                route_name(decision.client),
                decision.score,
                decision.is_default,
                getattr(decision, "scoring", scoring),
                scores,
            )
        )
    return out


def _as_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value, default=str).decode()


@dataclass(frozen=True)
class Layout:
    """The output's columns: fixed ones, the id, per-route scores when asked, kept columns.

    `id_type` / `keep_types` are Arrow types, or None for JSON values (kept as they are in
    JSON lines and written as their JSON text in CSV and Parquet).
    """

    routes: tuple[str, ...]
    with_scores: bool
    has_id: bool
    id_type: Any
    keep_types: dict[str, Any]

    @classmethod
    def of(cls, reader: Reader, routes: Sequence[str], *, with_scores: bool) -> Layout:
        """The layout for rows read by `reader`."""
        return cls(tuple(routes), with_scores, reader.has_id, reader.id_type, reader.keep_types)

    def as_text(self) -> Layout:
        """This layout with JSON-valued columns typed as text (what Arrow blocks carry)."""
        import pyarrow as pa

        return Layout(
            self.routes,
            self.with_scores,
            self.has_id,
            self.id_type or pa.string(),
            {name: kind or pa.string() for name, kind in self.keep_types.items()},
        )

    def schema(self) -> Any:
        """The Arrow schema of the CSV and Parquet outputs."""
        import pyarrow as pa

        fields: list[tuple[str, Any]] = [("line", pa.int64())]
        if self.has_id:
            fields.append(("id", self.id_type or pa.string()))
        fields += [
            ("route", pa.string()),
            ("score", pa.float64()),
            ("is_default", pa.bool_()),
            ("scoring", pa.string()),
        ]
        if self.with_scores:
            fields += [(f"score_{route}", pa.float64()) for route in self.routes]
        fields += [(name, kind or pa.string()) for name, kind in self.keep_types.items()]
        return pa.schema(fields)

    def lines(self, batch: RowBatch, results: Sequence[Result]) -> bytes:
        """The JSON lines of a batch: `line`, `id` (when the row has one), the decision,
        `scores` (route -> score for the routes in the top-K, with --scores), kept columns."""
        keep = list(batch.keep.items())
        out: list[bytes] = []
        dumps = orjson.dumps
        for row, (number, ident, result) in enumerate(
            zip(batch.lines, batch.ids, results, strict=True)
        ):
            record: dict[str, Any] = {"line": number}
            if ident is not None:
                record["id"] = ident
            record["route"] = result.route
            record["score"] = result.score
            record["is_default"] = result.is_default
            record["scoring"] = result.scoring
            if self.with_scores:
                record["scores"] = result.scores
            for name, values in keep:
                record[name] = values[row]
            out.append(dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE))
        return b"".join(out)

    def table(self, batch: RowBatch, results: Sequence[Result]) -> Any:
        """The batch as an Arrow table of `schema()`."""
        import pyarrow as pa

        schema = self.schema()
        columns: dict[str, Any] = {"line": batch.lines}
        if self.has_id:
            columns["id"] = batch.ids if self.id_type is not None else map(_as_text, batch.ids)
        columns["route"] = [r.route for r in results]
        columns["score"] = [r.score for r in results]
        columns["is_default"] = [r.is_default for r in results]
        columns["scoring"] = [r.scoring for r in results]
        if self.with_scores:
            for route in self.routes:
                columns[f"score_{route}"] = [r.scores.get(route) for r in results]
        for name, kind in self.keep_types.items():
            values = batch.keep[name]
            columns[name] = values if kind is not None else map(_as_text, values)
        arrays = [pa.array(list(columns[f.name]), type=f.type) for f in schema]
        return pa.Table.from_arrays(arrays, schema=schema)
