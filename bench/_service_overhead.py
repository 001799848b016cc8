"""Proxy overhead at concurrency 1: chatroute (and a bare relay) against direct upstream calls."""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import httpx

from bench._common import pct
from bench._service_start import process_cpu

QUESTION = "How do I reverse a list in Python?"


def _timed_call(
    client: httpx.Client, url: str, body: bytes, stream: bool, end: bytes = b"[DONE]"
) -> float:
    """Seconds to the full answer (non-streaming) or to the first content token (a stream
    must then go on to `end`, its last event)."""
    headers = {"content-type": "application/json"}
    started = time.perf_counter()
    if not stream:
        response = client.post(url, content=body, headers=headers)
        elapsed = time.perf_counter() - started
        if response.status_code != 200 or b"word0" not in response.content:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
        return elapsed
    first: float | None = None
    seen = b""
    with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}")
        for chunk in response.iter_raw():
            seen += chunk
            if first is None and b"word0" in seen:
                first = time.perf_counter() - started
    if first is None or end not in seen:
        raise RuntimeError(f"{url}: the stream had no content or no {end.decode()}")
    return first


def overhead(
    direct_url: str,
    service_url: str,
    service_pid: int,
    pairs: int,
    rounds: int,
    stream: bool,
    provider: str = "openai",
    floor_url: str | None = None,
) -> dict[str, Any]:
    """Added latency of chatroute over calling the upstream directly, in interleaved calls.

    With `floor_url` (a relay on the stack the chat endpoint runs on, with no chatroute
    code: `bench/proxy_floor.py`'s rung 5), a third arm goes through it in the same
    rotations, so the run also says what the stack alone adds at this moment.
    """
    messages = [{"role": "user", "content": QUESTION}]
    body = json.dumps({"model": "general", "messages": messages, "stream": stream}).encode()
    direct_body, direct_end = body, b"[DONE]"
    if provider == "anthropic":  # the direct arm speaks the upstream's own format
        direct_body = json.dumps(
            {"model": "fixed-model", "max_tokens": 4096, "messages": messages, "stream": stream}
        ).encode()
        direct_end = b"message_stop"
    direct_client = httpx.Client(timeout=30)
    service_client = httpx.Client(timeout=30)
    arms = {
        "direct": (direct_client, direct_url, direct_body, direct_end),
        "chatroute": (service_client, service_url, body, b"[DONE]"),
    }
    floor_client: httpx.Client | None = None
    if floor_url is not None:  # the relay forwards the body as it is
        floor_client = httpx.Client(timeout=30)
        arms["floor"] = (floor_client, floor_url, direct_body, direct_end)
    for _ in range(30):  # warm every arm's connection and code path
        for client, url, payload, end in arms.values():
            _timed_call(client, url, payload, stream, end)
    per_round = []
    for _ in range(rounds):
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        cpu_before = process_cpu(service_pid)
        for i in range(pairs):
            order = ["direct", "chatroute"] if i % 2 == 0 else ["chatroute", "direct"]
            if "floor" in arms:  # every order of the three arms once in six rotations
                order.insert(i % 3, "floor")
            for arm in order:
                client, url, payload, end = arms[arm]
                times[arm].append(_timed_call(client, url, payload, stream, end))
        cpu = (process_cpu(service_pid) - cpu_before) / pairs
        paired = [s - d for s, d in zip(times["chatroute"], times["direct"], strict=True)]
        per_round.append(
            {
                "direct_p50": pct(times["direct"], 0.5),
                "direct_p99": pct(times["direct"], 0.99),
                "service_p50": pct(times["chatroute"], 0.5),
                "service_p99": pct(times["chatroute"], 0.99),
                "added_p50": pct(times["chatroute"], 0.5) - pct(times["direct"], 0.5),
                "added_p99": pct(times["chatroute"], 0.99) - pct(times["direct"], 0.99),
                "paired_median": statistics.median(paired),
                "service_cpu": cpu,
                "floor_added_p50": (
                    pct(times["floor"], 0.5) - pct(times["direct"], 0.5)
                    if "floor" in times
                    else math.nan
                ),
            }
        )
    direct_client.close()
    service_client.close()
    if floor_client is not None:
        floor_client.close()
    ordered = sorted(per_round, key=lambda r: r["added_p50"])
    median_round = ordered[len(ordered) // 2]
    return {
        "median": median_round,
        "added_p50_rounds": [r["added_p50"] for r in per_round],
        "pairs": pairs,
        "rounds": rounds,
    }
