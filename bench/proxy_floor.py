"""The floor under the proxy-overhead target: what the bare serving stack adds on this machine.

Run from the repository root:

    .venv/bin/python bench/proxy_floor.py [--pairs 400] [--rounds 3] [--no-write]

It measures, exactly as section a. of bench/service_bench.py does (interleaved pairs at
concurrency 1, the same fixed-latency upstream, the same client), a pass-through proxy
that does nothing but relay: a FastAPI endpoint under uvicorn (uvloop and httptools when
installed) that reads the request body and forwards the bytes with one pooled aiohttp
session, returning the answer (or relaying the event stream chunk by chunk). No
validation, routing, failover, timeouts, metrics or error handling. Whatever it adds is
what the chosen stack (uvicorn, FastAPI, aiohttp) costs here before chatroute does any
work of its own. The result goes to the `proxy-floor` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._common import REPO, command, machine, table, write_section
from bench.service_bench import (
    _free_port,
    loadavg,
    overhead,
    running,
    start_upstream,
    uvicorn_stack,
)

FLOOR_APP = """
import sys
import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

UPSTREAM = f"http://127.0.0.1:{int(sys.argv[1])}/v1/chat/completions"
app = FastAPI()
sessions = []


def session():
    if not sessions:
        sessions.append(aiohttp.ClientSession())
    return sessions[0]


@app.post("/v1/chat/completions")
async def relay(request: Request) -> Response:
    body = await request.body()
    headers = {"content-type": "application/json"}
    if b'"stream":true' not in body.replace(b" ", b""):
        async with session().post(UPSTREAM, data=body, headers=headers) as answer:
            return Response(await answer.read(), media_type="application/json")
    answer = await session().post(UPSTREAM, data=body, headers=headers)

    async def chunks():
        try:
            async for chunk in answer.content.iter_any():
                yield chunk
        finally:
            answer.release()

    return StreamingResponse(chunks(), media_type="text/event-stream")


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def start_floor(stack: ExitStack, upstream_port: int, port: int, workdir: Path) -> int:
    argv = [sys.executable, "-c", FLOOR_APP, str(upstream_port), str(port)]
    proc = stack.enter_context(running(argv, log=workdir / "floor.log"))
    deadline = time.monotonic() + 60
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError((workdir / "floor.log").read_text(encoding="utf-8")[-2000:])
            try:
                client.get(f"http://127.0.0.1:{port}/docs")
                return proc.pid
            except httpx.TransportError:
                time.sleep(0.1)
    raise RuntimeError("the pass-through proxy did not start within 60 s")


def run(args: argparse.Namespace) -> str:
    load_before = loadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="chatroute-floor-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        upstream_port = start_upstream(stack, args, workdir)
        port = _free_port()
        pid = start_floor(stack, upstream_port, port, workdir)
        direct = f"http://127.0.0.1:{upstream_port}/v1/chat/completions"
        through = f"http://127.0.0.1:{port}/v1/chat/completions"
        for stream, mode in ((False, "non-streaming (full response)"), (True, "streaming (TTFT)")):
            result = overhead(direct, through, pid, args.pairs, args.rounds, stream)
            m = result["median"]
            rows.append(
                [
                    mode,
                    f"{m['direct_p50'] * 1e3:.2f}",
                    f"{m['service_p50'] * 1e3:.2f}",
                    f"{m['added_p50'] * 1e3:.2f}",
                    f"{m['paired_median'] * 1e3:.2f}",
                    f"{m['service_cpu'] * 1e3:.2f}",
                    " / ".join(f"{v * 1e3:.2f}" for v in result["added_p50_rounds"]),
                ]
            )
    lines = [
        "## Proxy-overhead floor: a bare pass-through on the same stack",
        "",
        f"- Machine: {machine()}; load average {load_before} before, {loadavg()} after.",
        f"- Command: `{command()}`",
        f"- Proxy: one FastAPI endpoint under uvicorn ({uvicorn_stack()}) relaying the body "
        "bytes through one pooled aiohttp session; no validation, routing, failover or "
        f"metrics. Upstream: `bench/_fixed_upstream.py`, fixed {args.delay_ms:g} ms delay. "
        f"{args.pairs} interleaved pairs per round, {args.rounds} rounds, median round shown "
        "(the method of section a. of the service benchmark).",
        "",
        table(
            [
                "mode",
                "direct p50 ms",
                "pass-through p50 ms",
                "added p50 ms",
                "paired median ms",
                "proxy CPU ms/req",
                "added p50 per round",
            ],
            rows,
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=10.0, help="the upstream's latency")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "proxy-floor", text)


if __name__ == "__main__":
    main()
