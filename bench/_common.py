"""Shared helpers for the benchmarks: machine description, data loading, timing, tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def clinc150_path() -> Path:
    """Where the CLINC150 data lies: $CHATROUTE_CLINC150 or ../shared/data/clinc150."""
    env = os.environ.get("CHATROUTE_CLINC150")
    return Path(env) if env else REPO.parent / "shared" / "data" / "clinc150"


def load_clinc150() -> dict[str, list[tuple[str, str]]]:
    """The data_full.json splits as lists of (text, intent)."""
    with open(clinc150_path() / "data_full.json", encoding="utf-8") as fh:
        raw = json.load(fh)
    return {k: [(t, i) for t, i in v] for k, v in raw.items()}


def local_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with 127.0.0.1 and localhost added to NO_PROXY (both spellings): the benches
    run everything on this machine, and a proxy set in the environment must not stand in
    between."""
    for name in ("NO_PROXY", "no_proxy"):
        env[name] = ",".join(filter(None, ["127.0.0.1,localhost", env.get(name)]))
    return env


def machine() -> str:
    """A one-line description of the machine the bench runs on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
        torch_v = f", torch {torch.__version__}, {torch.get_num_threads()} torch threads"
    except ImportError:  # pragma: no cover
        torch_v = ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}, Python {platform.python_version()}{torch_v}"


def command() -> str:
    """The command line that ran this bench."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def peak_rss_mb() -> float:
    """Peak resident set size of this process, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def write_section(path: Path, marker: str, body: str) -> None:
    """Replace (or append) the section between <!-- marker --> comments in a markdown file."""
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def bench_main(
    parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], str], section: str
) -> None:
    """Add the options the proxy benchmarks share (`--delay-ms`, `--no-write`), run, print
    the result and write it to `section` of BENCHMARKS.md."""
    parser.add_argument("--delay-ms", type=float, default=10.0, help="the upstream's latency")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", section, text)
