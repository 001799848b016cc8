"""Embeddings benchmark: `/v1/embeddings` under 64 clients against in-process `generate()`.

Run from the repository root:

    .venv/bin/python bench/embeddings_bench.py [--rounds 4] [--limit N] [--no-write]

It starts the real service (`chatroute serve --config <generated>`, embedder on the CPU
unless `--device` says otherwise, /v1 open) on a small CLINC150 routing config, and loads
the same model in this process (`SentenceTransformerEmbedder` with the library's defaults).
Every CLINC150 test query (or the first `--limit`) goes through each arm once per round:

- in-process `generate(texts)`: one call with all the texts, the library's defaults (its
  own batching, nothing in between): the reference;
- the same call with `workers=1` (one forward pass at a time over all of torch's intra-op
  threads, the default before two workers): what the default's choice is worth;
- in-process, 64 callers: `--clients` concurrent tasks, each awaiting `generate([text])`
  for one text at a time (the request shape the service sees, without HTTP);
- `/v1/embeddings`, base64 (what the openai SDK asks for by default) and float:
  `--clients` concurrent keep-alive connections, one text per request.

The arms take turns to go first over `--rounds` rounds. Each arm runs its own untimed
warm-up right before its clock (and its CPU counters) start: the same load on its first
256 texts (an HTTP arm first opens its connections and sends one request on each), so that
no arm's window starts with idle model threads and passes still settling in size. The
table shows each arm's median round, its ratio to the reference (the median of the
per-round ratios, each round's arms measured back to back), the forward passes it ran
(mean texts per pass, padded tokens per text: the in-process arms through a batch
listener, the service through its `/metrics` histograms), and CPU time per text: the
embedding process's (the bench process for the in-process arms, the service for the HTTP
arms, split into its event loop thread and the rest: model and tokeniser threads) and,
for the HTTP arms, the load client's own (this process, on the same cores). On a shared machine the wall-clock rates move with the other load, the CPU
cost much less. The vectors the service returns are checked against in-process ones. The
markdown result is printed and written to the `embeddings` section of BENCHMARKS.md
(`--no-write` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
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
WARM_TEXTS = 256  # each arm's own warm-up, right before its clock


@dataclass
class Cost:
    """What one arm's timed window cost: CPU seconds and the forward passes it ran."""

    cpu: float = 0.0  # the embedding process, every thread
    loop_cpu: float = 0.0  # the service's main (event loop) thread
    client_cpu: float = 0.0  # this process, driving the HTTP load
    passes: float = 0.0
    rows: float = 0.0
    padded: float = 0.0


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds one thread of a process has used so far; nan without /proc."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_HISTOGRAM = re.compile(
    r"^chatroute_embedder_batch_(size|tokens)_(sum|count)(?:\{[^}]*\})? ([0-9.e+]+)$", re.M
)


async def batch_counters(conn: Conn) -> dict[str, float]:
    """The service's forward-pass histograms: passes, texts and padded tokens so far."""
    conn.writer.write(b"GET /metrics HTTP/1.1\r\nhost: %s\r\n\r\n" % conn.host)
    head = await conn.reader.readuntil(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    text = (await conn.reader.readexactly(length)).decode()
    found = {f"{kind}_{stat}": float(value) for kind, stat, value in _HISTOGRAM.findall(text)}
    return {
        "passes": found.get("size_count", 0.0),
        "rows": found.get("size_sum", 0.0),
        "padded": found.get("tokens_sum", 0.0),
    }


async def service_load(
    port: int, pid: int, texts: Sequence[str], clients: int, encoding: str
) -> tuple[float, list[float], list[bytes], Cost]:
    """Every text once through /v1/embeddings by `clients` connections: texts/s, latencies,
    the answers in text order, and the cost of the timed window (after the warm-up)."""
    bodies = [
        json.dumps({"model": MODEL, "input": t, "encoding_format": encoding}).encode()
        for t in texts
    ]
    conns = [await Conn.open(port) for _ in range(clients)]
    for conn in conns:  # warm: every connection open and used once, off the clock
        await conn.post("/v1/embeddings", bodies[0])
    answers: list[bytes] = [b""] * len(bodies)
    latencies: list[float] = []

    async def worker(conn: Conn, queue: Iterator[tuple[int, bytes]], timed: bool) -> None:
        for i, body in queue:
            started = time.perf_counter()
            status, payload = await conn.post("/v1/embeddings", body)
            if status != 200:
                raise RuntimeError(f"/v1/embeddings: HTTP {status}: {payload[:200]!r}")
            if timed:
                latencies.append(time.perf_counter() - started)
                answers[i] = payload

    # Warm: the load itself for a moment, off the clock, so that the timed window starts
    # with the model threads busy, as every in-process arm's does (`WARM_TEXTS`).
    warm = iter(enumerate(bodies[:WARM_TEXTS]))
    await asyncio.gather(*(worker(c, warm, False) for c in conns))
    queue = iter(enumerate(bodies))

    before = await batch_counters(conns[0])
    cpu, loop_cpu, client_cpu = process_cpu(pid), thread_cpu(pid, pid), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(worker(c, queue, True) for c in conns))
    elapsed = time.perf_counter() - started
    cost = Cost(
        cpu=process_cpu(pid) - cpu,
        loop_cpu=thread_cpu(pid, pid) - loop_cpu,
        client_cpu=time.process_time() - client_cpu,
    )
    after = await batch_counters(conns[0])
    cost.passes, cost.rows, cost.padded = (after[k] - before[k] for k in before)
    for conn in conns:
        await conn.close()
    return len(bodies) / elapsed, latencies, answers, cost


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
    arms = ["bulk", "bulk1", "callers", "base64", "float"]
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    latencies: dict[str, list[list[float]]] = {"base64": [], "float": []}
    costs: dict[str, list[Cost]] = {arm: [] for arm in arms}
    loads: list[float] = []
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
        # One pass at a time over every intra-op thread, on the same loaded model.
        single = SentenceTransformerEmbedder(_runner=embedder._runner, warmup=False, workers=1)
        stack.callback(single.close)
        passes: list[tuple[int, int]] = []
        for emb in (embedder, single):
            emb.add_batch_listener(lambda size, padded: passes.append((size, padded)))
        loop = asyncio.new_event_loop()
        stack.callback(loop.close)

        def in_process(arm: str, batch: Sequence[str]) -> Coroutine[Any, Any, float]:
            if arm == "callers":
                return callers_load(embedder, batch, args.clients)
            return bulk_load(embedder if arm == "bulk" else single, batch)

        for round_ in range(args.rounds):
            # Each arm leads a round in turn, after its own warm-up (`WARM_TEXTS`): an arm
            # that followed a pause otherwise paid for waking idle threads and for passes
            # that had not settled (in HTTP arms after the in-process ones, 28 texts a pass
            # against 31-32).
            order = arms[round_ % len(arms) :] + arms[: round_ % len(arms)]
            for arm in order:
                if arm in ("bulk", "bulk1", "callers"):
                    loop.run_until_complete(in_process(arm, texts[:WARM_TEXTS]))
                    passes.clear()
                    cpu_before = time.process_time()  # this process, every thread
                    rate = loop.run_until_complete(in_process(arm, texts))
                    cost = Cost(cpu=time.process_time() - cpu_before)
                    cost.passes = len(passes)
                    cost.rows = sum(size for size, _ in passes)
                    cost.padded = sum(padded for _, padded in passes)
                else:
                    rate, lat, answers, cost = loop.run_until_complete(
                        service_load(port, pid, texts, args.clients, arm)
                    )
                    latencies[arm].append(lat)
                    sample = list(range(0, len(texts), max(1, len(texts) // 200)))
                    want = loop.run_until_complete(embedder.generate([texts[i] for i in sample]))
                    got = np.stack([vector_of(answers[i]) for i in sample])
                    worst = max(worst, float(np.abs(got - want).max()))
                rates[arm].append(rate)
                costs[arm].append(cost)
                loads.append(os.getloadavg()[0])
                print(
                    f"round {round_ + 1} {arm}: {rate:.1f} texts/s, "
                    f"{cost.cpu / len(texts) * 1000:.2f} ms CPU/text, "
                    f"{cost.rows / max(cost.passes, 1):.1f} texts/pass, "
                    f"load {loads[-1]:.2f}",
                    file=sys.stderr,
                )
        threads = max(1, torch.get_num_threads() // embedder.workers)
        workers = f"{embedder.workers} model worker(s) x {threads}"
        mean_len = statistics.mean(len(e.ids) for e in embedder._runner._encode(texts))
    load_after = loadavg()
    if worst > 1e-4:
        raise RuntimeError(f"the service's vectors differ from generate() by {worst:g}")

    def ratio_rounds(arm: str, base: str) -> list[float]:
        return [a / b for a, b in zip(rates[arm], rates[base], strict=True)]

    def median_round(arm: str) -> int:
        ordered = sorted(range(args.rounds), key=lambda r: rates[arm][r])
        return ordered[len(ordered) // 2]

    def per_text(arm: str, field: str) -> float:
        return statistics.median(getattr(c, field) / len(texts) for c in costs[arm])

    def ms_text(value: float) -> str:
        return f"{value * 1000:.2f}"

    bulk_cpu = per_text("bulk", "cpu")
    rows = []
    labels = {
        "bulk": "in-process `generate(texts)`, one call (library defaults)",
        "bulk1": "in-process `generate(texts)`, one call, `workers=1`",
        "callers": f"in-process `generate([text])`, {args.clients} concurrent callers",
        "base64": f"`/v1/embeddings` base64, {args.clients} clients",
        "float": f"`/v1/embeddings` float, {args.clients} clients",
    }
    for arm in arms:
        mid = median_round(arm)
        vs_bulk = statistics.median(ratio_rounds(arm, "bulk"))
        arm_cpu = per_text(arm, "cpu")
        mid_cost = costs[arm][mid]
        row: list[Any] = [
            labels[arm],
            f"{rates[arm][mid]:,.0f}",
            f"{vs_bulk:.2f}",
            f"{mid_cost.rows / max(mid_cost.passes, 1):.1f}",
            f"{mid_cost.padded / max(mid_cost.rows, 1):.1f}",
            ms_text(arm_cpu),
        ]
        if arm in latencies:
            client_cpu = per_text(arm, "client_cpu")
            lat = latencies[arm][mid]
            row += [
                ms_text(per_text(arm, "loop_cpu")),
                ms_text(client_cpu),
                f"{bulk_cpu / (arm_cpu + client_cpu):.2f}",
                f"{statistics.median(ratio_rounds(arm, 'callers')):.2f}",
                f"{pct(lat, 0.5) * 1000:.1f}",
                f"{pct(lat, 0.99) * 1000:.1f}",
                "met" if vs_bulk >= 0.8 else "missed",
            ]
        else:
            row += ["", "", f"{bulk_cpu / arm_cpu:.2f}", "", "", "", ""]
        rows.append(row)
    per_round = "; ".join(f"{arm} " + " / ".join(f"{r:,.0f}" for r in rates[arm]) for arm in arms)
    lines = [
        "## Embeddings API (bench/embeddings_bench.py)",
        "",
        f"- Machine: {machine()}; load average {load_before} before, {load_after} after, "
        f"{min(loads):.2f}-{max(loads):.2f} (1 min) across the arms (the machine may be "
        "shared with other jobs).",
        f"- Command: `{command()}`",
        f"- Texts: {len(texts)} CLINC150 test queries, each arm every text once per round, "
        f"{args.rounds} rounds, each arm first in turn and each after its own untimed "
        f"warm-up (the same load on {WARM_TEXTS} texts); one text per request. Service: "
        f"`chatroute serve`, embedder `{MODEL}` on `{args.device}` ({workers} intra-op "
        "threads), /v1 open; the load client is a minimal asyncio "
        "HTTP/1.1 client (keep-alive) in the bench process, on the same cores. The "
        "in-process arms run the same model with the same settings in the bench process.",
        "",
        table(
            [
                "path",
                "texts/s",
                "vs one generate() call",
                "texts/pass",
                "padded tokens/text",
                "CPU ms/text",
                "of which event loop",
                "client CPU ms/text",
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
        "(max abs difference on a sample of each round). Texts/pass and padded tokens/text: "
        "the forward passes of the arm's median round (the texts' own length averages "
        f"{mean_len:.1f} tokens). CPU ms/text: the CPU "
        "time (all threads) of the process doing the embedding, the bench process for the "
        "in-process arms and the service for the HTTP arms, after the warm-up (median "
        "round); the event loop is the service's main thread, the rest its model and "
        "tokeniser threads. CPU vs one generate() call is the reference's CPU per text over "
        "the arm's (the service's plus the load client's for the HTTP arms): the throughput "
        "ratio on a machine whose cores the bench had to itself and kept busy, whatever "
        "else the shared machine was running.",
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
