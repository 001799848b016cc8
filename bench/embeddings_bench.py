"""Embeddings benchmark: `/v1/embeddings` under 64 clients against in-process `generate()`.

Run from the repository root:

    .venv/bin/python bench/embeddings_bench.py [--rounds 4] [--limit N] [--no-write]

It starts the real service (`chatroute serve --config <generated>`, embedder on the CPU
unless `--device` says otherwise, /v1 open) on a small CLINC150 routing config, and loads
the same model in this process (`SentenceTransformerEmbedder`, the same settings). Every
CLINC150 test query (or the first `--limit`) goes through each arm once per round:

- in-process `generate(texts)`: one call with all the texts (the library's own batching,
  nothing in between): the reference;
- in-process, 64 callers: `--clients` concurrent tasks, each awaiting `generate([text])`
  for one text at a time (the request shape the service sees, without HTTP);
- `/v1/embeddings`, base64 (what the openai SDK asks for by default) and float:
  `--clients` concurrent keep-alive connections, one text per request.

The arms take turns to go first over `--rounds` rounds, each round after an untimed
warm-up of both sides. The table shows each arm's median round, its ratio to the reference
(the median of the per-round ratios, each round's arms measured back to back), and the CPU
time each arm's embedding process spent per text (the bench process for the in-process
arms, the service for the HTTP arms): on a shared machine the wall-clock rates move with
the other load, the CPU cost much less. The vectors the service returns are checked
against in-process ones. The markdown result is printed and written to the `embeddings`
section of BENCHMARKS.md (`--no-write` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, command, load_clinc150, machine, pct, table, write_section
from bench.service_bench import (
    Conn,
    _free_port,
    loadavg,
    make_config,
    process_cpu,
    start_service,
)
from chatroute.embedder import SentenceTransformerEmbedder

MODEL = "default"


async def service_load(
    port: int, texts: Sequence[str], clients: int, encoding: str
) -> tuple[float, list[float], list[bytes]]:
    """Every text once through /v1/embeddings by `clients` connections: texts/s, latencies,
    and the answers in text order."""
    bodies = [
        json.dumps({"model": MODEL, "input": t, "encoding_format": encoding}).encode()
        for t in texts
    ]
    conns = [await Conn.open(port) for _ in range(clients)]
    for conn in conns:  # warm
        await conn.post("/v1/embeddings", bodies[0])
    answers: list[bytes] = [b""] * len(bodies)
    latencies: list[float] = []
    queue = iter(enumerate(bodies))

    async def worker(conn: Conn) -> None:
        for i, body in queue:
            started = time.perf_counter()
            status, payload = await conn.post("/v1/embeddings", body)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"/v1/embeddings: HTTP {status}: {payload[:200]!r}")
            answers[i] = payload

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - started
    for conn in conns:
        await conn.close()
    return len(bodies) / elapsed, latencies, answers


async def callers_load(
    embedder: SentenceTransformerEmbedder, texts: Sequence[str], clients: int
) -> float:
    """Every text once through `generate([text])` by `clients` concurrent tasks: texts/s."""
    queue = iter(texts)

    async def worker() -> None:
        for text in queue:
            await embedder.generate([text])

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return len(texts) / (time.perf_counter() - started)


async def bulk_load(embedder: SentenceTransformerEmbedder, texts: Sequence[str]) -> float:
    """All texts in one `generate(texts)` call: texts/s."""
    started = time.perf_counter()
    await embedder.generate(list(texts))
    return len(texts) / (time.perf_counter() - started)


def vector_of(answer: bytes) -> np.ndarray:
    item = json.loads(answer)["data"][0]["embedding"]
    if isinstance(item, str):
        return np.frombuffer(base64.b64decode(item), dtype="<f4")
    return np.asarray(item, dtype=np.float32)


def run(args: argparse.Namespace) -> str:
    data = load_clinc150()
    texts = [t for t, _ in data["test"]]
    if args.limit:
        texts = texts[: args.limit]
    print(f"{len(texts)} texts, {args.clients} clients, {args.rounds} rounds", file=sys.stderr)
    load_before = loadavg()
    arms = ["bulk", "callers", "base64", "float"]
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    latencies: dict[str, list[list[float]]] = {"base64": [], "float": []}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    worst = 0.0
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        port = _free_port()
        config = make_config(data, _free_port(), port, per_route=2)
        config["embedder"]["device"] = args.device
        config_path = workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        pid = start_service(stack, config_path, port, workdir)
        embedder = SentenceTransformerEmbedder(MODEL, device=args.device)
        stack.callback(embedder.close)
        loop = asyncio.new_event_loop()
        stack.callback(loop.close)
        loop.run_until_complete(embedder.generate(texts[:256]))  # warm
        for round_ in range(args.rounds):
            # Each arm leads a round in turn, after an untimed warm-up of both sides (the
            # first arm after a pause otherwise pays for waking the idle threads up).
            order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
            loop.run_until_complete(callers_load(embedder, texts[:256], args.clients))
            loop.run_until_complete(service_load(port, texts[:256], args.clients, "base64"))
            for arm in order:
                if arm in ("bulk", "callers"):
                    cpu_before = time.process_time()  # this process, every thread
                    if arm == "bulk":
                        rate = loop.run_until_complete(bulk_load(embedder, texts))
                    else:
                        work = callers_load(embedder, texts, args.clients)
                        rate = loop.run_until_complete(work)
                    cpu[arm].append((time.process_time() - cpu_before) / len(texts))
                else:
                    cpu_before = process_cpu(pid)
                    rate, lat, answers = loop.run_until_complete(
                        service_load(port, texts, args.clients, arm)
                    )
                    cpu[arm].append((process_cpu(pid) - cpu_before) / len(texts))
                    latencies[arm].append(lat)
                    sample = list(range(0, len(texts), max(1, len(texts) // 200)))
                    want = loop.run_until_complete(embedder.generate([texts[i] for i in sample]))
                    got = np.stack([vector_of(answers[i]) for i in sample])
                    worst = max(worst, float(np.abs(got - want).max()))
                rates[arm].append(rate)
                print(f"round {round_ + 1} {arm}: {rate:.1f} texts/s", file=sys.stderr)
    load_after = loadavg()
    if worst > 1e-4:
        raise RuntimeError(f"the service's vectors differ from generate() by {worst:g}")

    def ratio_rounds(arm: str, base: str) -> list[float]:
        return [a / b for a, b in zip(rates[arm], rates[base], strict=True)]

    def median_round(arm: str) -> int:
        ordered = sorted(range(args.rounds), key=lambda r: rates[arm][r])
        return ordered[len(ordered) // 2]

    bulk_cpu = statistics.median(cpu["bulk"])
    rows = []
    labels = {
        "bulk": "in-process `generate(texts)`, one call",
        "callers": f"in-process `generate([text])`, {args.clients} concurrent callers",
        "base64": f"`/v1/embeddings` base64, {args.clients} clients",
        "float": f"`/v1/embeddings` float, {args.clients} clients",
    }
    for arm in arms:
        mid = median_round(arm)
        vs_bulk = statistics.median(ratio_rounds(arm, "bulk"))
        arm_cpu = statistics.median(cpu[arm])
        row: list[Any] = [
            labels[arm],
            f"{rates[arm][mid]:,.0f}",
            f"{vs_bulk:.2f}",
            f"{arm_cpu * 1000:.2f}",
            f"{bulk_cpu / arm_cpu:.2f}",
        ]
        if arm in latencies:
            vs_callers = statistics.median(ratio_rounds(arm, "callers"))
            lat = latencies[arm][mid]
            row += [
                f"{vs_callers:.2f}",
                f"{pct(lat, 0.5) * 1000:.1f}",
                f"{pct(lat, 0.99) * 1000:.1f}",
                "met" if vs_bulk >= 0.8 else "missed",
            ]
        else:
            row += ["", "", "", ""]
        rows.append(row)
    per_round = "; ".join(f"{arm} " + " / ".join(f"{r:,.0f}" for r in rates[arm]) for arm in arms)
    lines = [
        "## Embeddings API (bench/embeddings_bench.py)",
        "",
        f"- Machine: {machine()}; load average {load_before} before, {load_after} after "
        "(the machine may be shared with other jobs).",
        f"- Command: `{command()}`",
        f"- Texts: {len(texts)} CLINC150 test queries, each arm every text once per round, "
        f"{args.rounds} rounds, each arm first in turn, after an untimed warm-up; one text per request. Service: "
        f"`chatroute serve`, embedder `{MODEL}` on `{args.device}`, /v1 open; the load "
        "client is a minimal asyncio HTTP/1.1 client (keep-alive). The in-process arms "
        "run the same model with the same settings in the bench process.",
        "",
        table(
            [
                "path",
                "texts/s",
                "vs one generate() call",
                "CPU ms/text",
                "CPU vs one generate() call",
                "vs in-process callers",
                "p50 ms",
                "p99 ms",
                "target ≥ 0.8x generate()",
            ],
            rows,
        ),
        "",
        f"Per round (texts/s): {per_round}. Ratios are medians of the per-round ratios; "
        f"the service's vectors matched in-process `generate()` within {worst:.1e} "
        "(max abs difference on a sample of each round). CPU ms/text: the CPU time "
        "(all threads) of the process doing the embedding, the bench process for the "
        "in-process arms and the service for the HTTP arms (median round); its ratio to "
        "the one-call arm is what throughput would be on a machine the bench had to "
        "itself, whatever else the shared machine was running.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4, help="4: each arm leads one round")
    parser.add_argument("--limit", type=int, default=0, help="only the first N test texts")
    parser.add_argument("--device", default="cpu", help="the embedder's device (both sides)")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "embeddings", text)


if __name__ == "__main__":
    main()
