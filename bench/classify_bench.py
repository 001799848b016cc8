"""Bulk classification: in-process route_batch vs `chatroute classify` local and Ray engines.

100,000 rows of CLINC150 text (the utterances of every split, cycled) in one JSONL file;
150 routes (the CLINC150 intents, 10 train utterances each). Measured, on the same rows:

- `route_batch` in this process, 256 queries a call (the ceiling: no reading or writing);
- `chatroute classify` (local engine) JSONL -> Parquet, as a separate process;
- `chatroute classify --engine ray` on a local Ray instance (2 CPUs), 1 and 2 actors.

Rates of the commands come from their `--summary` (the local engine's excludes loading the
model; the Ray engine's covers the whole Ray Data run after the instance started: actors
loading the model included). Driver peak RSS is the command process's own (`wait4`).
Writes its section of BENCHMARKS.md between the `classify-bulk` markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _common import REPO, command, load_clinc150, machine, table, write_section

ROUTES_PER_INTENT = 10


def make_inputs(rows: int, folder: Path) -> tuple[Path, Path, list[str]]:
    """The JSONL input, the config and the texts."""
    data = load_clinc150()
    pool = [text for split in data.values() for text, _ in split]
    texts = [pool[n % len(pool)] for n in range(rows)]
    source = folder / "in.jsonl"
    with open(source, "w", encoding="utf-8") as fh:
        for n, text in enumerate(texts):
            fh.write(json.dumps({"id": n, "input": text}) + "\n")
    intents: dict[str, list[str]] = {}
    for text, intent in data["train"]:
        if intent != "oos" and len(intents.setdefault(intent, [])) < ROUTES_PER_INTENT:
            intents[intent].append(text)
    config = {
        "routing": {"top_k": 5, "threshold": 0.3, "default_route": "fallback"},
        "embedder": {"device": "cpu"},
        "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
        "routes": {
            "fallback": {"targets": ["p"]},
            **{name: {"utterances": u, "targets": ["p"]} for name, u in intents.items()},
        },
    }
    path = folder / "chatroute.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return source, path, texts


def route_batch_rate(config_path: Path, texts: list[str]) -> float:
    """Queries per second of `Engine.decide_batch` (route_batch) in this process."""
    from chatroute.config import load_config
    from chatroute.engine import build_engine

    async def work() -> float:
        engine = build_engine(load_config(config_path))
        try:
            await engine.warm()
            started = time.perf_counter()
            for start in range(0, len(texts), 256):
                await engine.decide_batch(texts[start : start + 256])
            return len(texts) / (time.perf_counter() - started)
        finally:
            await engine.aclose()

    return asyncio.run(work())


def classify(config: Path, source: Path, out: Path, *extra: str) -> dict[str, Any]:
    """Run `chatroute classify` in its own process; its summary, wall time and peak RSS."""
    summary = out.with_suffix(".summary.json")
    code = "import sys; from chatroute.cli import main; sys.argv[0] = 'chatroute'; main()"
    args = [sys.executable, "-c", code, "classify", "-c", str(config), str(source), "-o",
            str(out), "--summary", str(summary), "--no-progress", "--overwrite", *extra]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.perf_counter()
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert process.stderr is not None
    err = process.stderr.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"classify {' '.join(extra)} failed:\n{err.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(summary.read_text())
    result["wall_s"] = wall
    result["driver_rss_mib"] = usage.ru_maxrss / 1024
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source, config, texts = make_inputs(args.rows, folder)
        load_before = os.getloadavg()
        baseline = route_batch_rate(config, texts)
        print(f"route_batch: {baseline:,.0f} rows/s", flush=True)
        runs: list[tuple[str, dict[str, Any]]] = []
        local = classify(config, source, folder / "local.parquet")
        runs.append(("local engine (JSONL -> Parquet file)", local))
        print(f"local: {local['inputs_per_s']:,.0f} rows/s", flush=True)
        for actors in (1, 2):
            result = classify(
                config, source, folder / f"ray{actors}", "--engine", "ray",
                "--num-actors", str(actors), "--batch-size", "256",
            )  # fmt: skip
            runs.append((f"Ray engine, local instance, {actors} actor(s)", result))
            print(f"ray {actors}: {result['inputs_per_s']:,.0f} rows/s", flush=True)
        load_after = os.getloadavg()
    rows = [["in-process `route_batch` (256 a call)", f"{baseline:,.0f}", "1.00", "-", "-", "-"]]
    for name, result in runs:
        rate = result["inputs_per_s"]
        rows.append(
            [
                name,
                f"{rate:,.0f}",
                f"{rate / baseline:.2f}",
                f"{rate / local['inputs_per_s']:.2f}",
                f"{result['wall_s']:.0f}",
                f"{result['driver_rss_mib']:,.0f}",
            ]
        )
    text = "\n".join(
        [
            "## Bulk classification (`chatroute classify`, issue 30)",
            "",
            f"- Machine: {machine()}; load average {load_before[0]:.2f} before, "
            f"{load_after[0]:.2f} after (the machine may be shared with other jobs).",
            f"- Command: `{command()}` (from the repository root, after `make install`)",
            f"- {args.rows:,} rows of CLINC150 text (every split's utterances, cycled) in one "
            "JSONL file; 150 routes of 10 utterances; top_k 5; all-MiniLM-L6-v2 on the CPU.",
            "- rows/s of a command: from its `--summary` (local: after the model loaded; Ray: "
            "the whole Ray Data run after the instance started, actor start-up included). "
            "Wall s: the whole command, model loading and Ray start included. RSS: the "
            "driver process's peak.",
            "",
            table(
                ["path", "rows/s", "x route_batch", "x local", "wall s", "driver peak RSS MiB"],
                rows,
            ),
        ]
    )
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "classify-bulk", text)


if __name__ == "__main__":
    main()
