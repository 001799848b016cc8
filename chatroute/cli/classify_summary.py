"""The per-route breakdown of a classification run: counts, shares, mean scores, defaults."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich.table import Table

__all__ = ["Summary"]


class Summary:
    """Counts per route of the rows an output holds, and the run's bad and empty rows.

    A row without a score is one no search ran for: an empty text (classified as the
    default route). `resumed` counts the rows an earlier run had already written.
    """

    def __init__(self, routes: Sequence[str]) -> None:
        self.routes = list(routes)
        self.count: dict[str, int] = dict.fromkeys(self.routes, 0)
        self.score_sum: dict[str, float] = dict.fromkeys(self.routes, 0.0)
        self.scored: dict[str, int] = dict.fromkeys(self.routes, 0)
        self.defaults: dict[str, int] = dict.fromkeys(self.routes, 0)
        self.empty = 0
        self.bad = 0
        self.resumed = 0

    def add(self, route: str, score: float | None, is_default: bool) -> None:
        """Count one written row."""
        if route not in self.count:
            self.routes.append(route)
            self.count[route] = self.scored[route] = self.defaults[route] = 0
            self.score_sum[route] = 0.0
        self.count[route] += 1
        if score is None:
            self.empty += 1
        else:
            self.score_sum[route] += score
            self.scored[route] += 1
        if is_default:
            self.defaults[route] += 1

    def add_columns(
        self, routes: Iterable[str], scores: Iterable[float | None], defaults: Iterable[bool]
    ) -> None:
        """Count rows given column-wise."""
        for route, score, is_default in zip(routes, scores, defaults, strict=True):
            self.add(route, score, bool(is_default))

    def merge(self, other: Summary) -> None:
        """Add the rows `other` counted (its bad and resumed counts are not added)."""
        for route in other.routes:
            if route not in self.count:
                self.routes.append(route)
                self.count[route] = self.scored[route] = self.defaults[route] = 0
                self.score_sum[route] = 0.0
            self.count[route] += other.count[route]
            self.score_sum[route] += other.score_sum[route]
            self.scored[route] += other.scored[route]
            self.defaults[route] += other.defaults[route]
        self.empty += other.empty

    @property
    def total(self) -> int:
        """Rows counted."""
        return sum(self.count.values())

    def rows(self) -> list[dict[str, Any]]:
        """One entry per route: name, count, share, mean score (None if none), default share."""
        total = self.total
        out = []
        for route in self.routes:
            count = self.count[route]
            scored = self.scored[route]
            out.append(
                {
                    "route": route,
                    "count": count,
                    "share": count / total if total else 0.0,
                    "mean_score": self.score_sum[route] / scored if scored else None,
                    "default_share": self.defaults[route] / count if count else 0.0,
                }
            )
        return out

    def to_dict(self, **extra: Any) -> dict[str, Any]:
        """The summary as JSON-ready data, with `extra` keys (rate, elapsed, ...) added."""
        return {
            "total": self.total,
            "empty": self.empty,
            "bad": self.bad,
            "resumed": self.resumed,
            "routes": self.rows(),
            **extra,
        }

    def table(self) -> Table:
        """The per-route table for the terminal."""
        table = Table(title="classified", title_justify="left")
        table.add_column("route")
        for name in ("count", "share", "mean score", "default share"):
            table.add_column(name, justify="right")
        for row in self.rows():
            mean = row["mean_score"]
            table.add_row(
                row["route"],
                f"{row['count']:,}",
                f"{row['share']:.1%}",
                "-" if mean is None else f"{mean:.3f}",
                f"{row['default_share']:.1%}",
            )
        table.add_section()
        table.add_row("total", f"{self.total:,}", "100.0%" if self.total else "-", "", "")
        return table
