"""Proxy overhead: one client, requests in sequence, straight to an upstream vs through the service.

Run: `.venv/bin/python bench/proxy_overhead.py [--requests 300] [--chunks 20] [--json PATH]`

The service runs in its own process (as in bench/load_soak.py) in front of a scripted
fake upstream on 127.0.0.1 that answers at once (`chunks` streamed chunks, no delays).
Each request is sent alternately to the fake directly and through the service's named
route (no semantic routing, so no embedding), non-streamed and streamed; the report gives
p50/p99 of the time to the first content byte and to the end, and the difference: what
the service adds per request on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._common import command, machine, pct, table
from bench._soak_service import Service
from tests.fakes import FakeUpstream, Ok


def config(url: str) -> dict[str, Any]:
    return {
        "server": {"log_level": "error"},
        "embedder": {"model": "default", "device": "cpu"},
        "routing": {"default_route": "direct", "threshold": 0.3},
        "resilience": {"deadline": 60},
        "providers": {
            "fake": {
                "base_url": url,
                "model": "fake-model",
                "timeouts": {"first_token": 10, "stall": 10, "attempt": 30},
            }
        },
        "routes": {"direct": {"targets": ["fake"], "utterances": ["hello"]}},
    }


async def timed(
    client: httpx.AsyncClient, url: str, stream: bool, model: str
) -> tuple[float, float]:
    body = {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
        async for chunk in response.aiter_bytes():
            if first is None and b'"content"' in chunk:
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    return (first if first is not None else total), total


async def measure(args: argparse.Namespace, service: Service, fake: FakeUpstream) -> dict[str, Any]:
    direct_url = f"{fake.base_url}/chat/completions"
    routed_url = f"{service.url}/v1/chat/completions"
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for stream in (False, True):
            for _ in range(20):  # warm both paths and their connection pools
                await timed(client, direct_url, stream, "fake-model")
                await timed(client, routed_url, stream, "direct")
            rows: dict[str, list[tuple[float, float]]] = {"direct": [], "routed": []}
            for _ in range(args.requests):
                rows["direct"].append(await timed(client, direct_url, stream, "fake-model"))
                rows["routed"].append(await timed(client, routed_url, stream, "direct"))
            out["stream" if stream else "plain"] = rows
    return out


def report(args: argparse.Namespace, data: dict[str, Any]) -> str:
    ms = 1000.0
    rows = []
    for mode, label in (("plain", "non-streamed"), ("stream", f"streamed, {args.chunks} chunks")):
        for index, what in ((0, "first content"), (1, "end")):
            if mode == "plain" and index == 0:
                continue
            direct = [r[index] for r in data[mode]["direct"]]
            routed = [r[index] for r in data[mode]["routed"]]
            rows.append(
                (
                    f"{label}: to the {what}",
                    f"{pct(direct, 0.5) * ms:.2f} / {pct(direct, 0.99) * ms:.2f}",
                    f"{pct(routed, 0.5) * ms:.2f} / {pct(routed, 0.99) * ms:.2f}",
                    f"{(pct(routed, 0.5) - pct(direct, 0.5)) * ms:.2f}",
                )
            )
    return "\n".join(
        [
            "## Proxy overhead (bench/proxy_overhead.py)",
            "",
            f"Command: `{command()}`",
            "",
            f"Machine: {machine()}. One client, {args.requests} requests per row in sequence, "
            "alternating between the fake upstream directly and the service's named route "
            "(the service in its own process).",
            "",
            table(
                [
                    "request",
                    "direct p50 / p99 ms",
                    "through chatroute p50 / p99 ms",
                    "added p50 ms",
                ],
                rows,
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    text = " ".join(f"w{i}" for i in range(args.chunks))
    with FakeUpstream(default=Ok(text)) as fake:
        service = Service(config(fake.base_url))
        try:
            service.wait_ready()
            data = asyncio.run(measure(args, service, fake))
        finally:
            service.close()
    print(report(args, data))
    if args.json is not None:
        args.json.write_text(json.dumps(data), encoding="utf-8")


if __name__ == "__main__":
    main()
