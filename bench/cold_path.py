"""What each step of a proxied chat call costs with the CPU caches warm and with them cold.

Run from the repository root:

    .venv/bin/python bench/cold_path.py [--repeats 100] [--no-write]

At concurrency 1 the service sits idle for the whole upstream latency between the two
halves of every call (request in, upstream request out; upstream answer in, reply out).
On a shared or virtual machine that idle time is long enough for the CPU caches to lose
the service's code and data, so each half starts cold. This bench runs chatroute's own
per-call steps in-process (no sockets, no event loop), each timed right after the same
call (warm) and right after the caches were evicted by copying a buffer several times the
size of the last-level cache (cold):

1. parse the request body (`parse_json`, the admission's JSON parse);
2. validate it (`ChatCompletionRequest`, pydantic);
3. convert it to chat types (`to_chat_messages`, `to_chat_options`);
4. build and encode the upstream request (`build_request`, `orjson.dumps`);
5. parse the upstream's answer (`orjson.loads`);
6. map it to a `ChatResponse` (`response_from_openai`);
7. encode the reply (`completion_body`);

then all seven in a row after one eviction (later steps find the code the earlier ones
brought back), and a timed call that does nothing. The result goes to the `cold-path`
section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from bench._common import REPO, command, machine, table, write_section
from chatroute.providers.mapping import build_request, response_from_openai
from chatroute.server.guard import parse_json
from chatroute.server.wire import (
    ChatCompletionRequest,
    completion_body,
    to_chat_messages,
    to_chat_options,
)

REQUEST = (
    b'{"model":"general","messages":[{"role":"user","content":'
    b'"What is the capital of France, and why is it the capital?"}],"stream":false}'
)
ANSWER = (
    b'{"id":"chatcmpl-fixed","object":"chat.completion","created":1796082262,'
    b'"model":"fixed-model","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"word0 word1 word2 word3 word4 word5 word6 word7 "},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":8,'
    b'"total_tokens":20}}'
)
_VALIDATE = ChatCompletionRequest.model_validate
# The single steps come first in `steps()`, then all of them in a row, then a no-op.
_STEPS = 7


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (0 when it says nothing)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text(encoding="ascii").strip()
        scale = {"K": 1024, "M": 1024**2}.get(text[-1:], 1)
        digits = text.rstrip("KM")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=0)


class Evictor:
    """Pushes this process's code and data out of the CPU caches by copying a buffer
    twice the size of the last-level cache (32 MiB at least) over another."""

    def __init__(self) -> None:
        size = max(32 * 1024**2, 2 * last_level_cache_bytes())
        self.size = size
        self._source = b"\x01" * size  # written pages (a zeroed buffer maps one page)
        self._target = bytearray(size)

    def __call__(self) -> None:
        self._target[:] = self._source


def steps() -> list[tuple[str, Callable[[], Any]]]:
    """The steps, each a call on inputs made ahead (as the step before would hand them)."""
    data = parse_json(REQUEST, 64)
    request = _VALIDATE(data)
    messages = to_chat_messages(request.messages)
    options = to_chat_options(request)
    answer = orjson.loads(ANSWER)
    response = response_from_openai(answer, provider="fixed")

    def to_chat() -> None:
        to_chat_messages(request.messages)
        to_chat_options(request)

    def upstream_request() -> None:
        orjson.dumps(build_request(messages, options, default_model="fixed-model", stream=False))

    def whole() -> None:
        request = _VALIDATE(parse_json(REQUEST, 64))
        messages = to_chat_messages(request.messages)
        options = to_chat_options(request)
        orjson.dumps(build_request(messages, options, default_model="fixed-model", stream=False))
        response = response_from_openai(orjson.loads(ANSWER), provider="fixed")
        completion_body(response, model="fixed-model")

    return [
        ("1. parse the request body", lambda: parse_json(REQUEST, 64)),
        ("2. validate it (pydantic)", lambda: _VALIDATE(data)),
        ("3. convert it to chat types", to_chat),
        ("4. build and encode the upstream request", upstream_request),
        ("5. parse the upstream answer", lambda: orjson.loads(ANSWER)),
        ("6. map it to a ChatResponse", lambda: response_from_openai(answer, provider="fixed")),
        ("7. encode the reply", lambda: completion_body(response, model="fixed-model")),
        ("1-7 in a row", whole),
        ("a timed call that does nothing", lambda: None),
    ]


def measure(call: Callable[[], Any], evict: Evictor, repeats: int) -> tuple[float, float]:
    """Median seconds of `call` warm and cold, over `repeats` alternations."""
    clock = time.perf_counter
    warm: list[float] = []
    cold: list[float] = []
    call()
    for _ in range(repeats):
        evict()
        started = clock()
        call()
        cold.append(clock() - started)
        started = clock()
        call()
        warm.append(clock() - started)
    return statistics.median(warm), statistics.median(cold)


def run(args: argparse.Namespace) -> str:
    evict = Evictor()
    measured = [(name, *measure(call, evict, args.repeats)) for name, call in steps()]
    rows = [[name, f"{w * 1e6:.1f}", f"{c * 1e6:.1f}", f"{c / w:.1f}"] for name, w, c in measured]
    apart = measured[:_STEPS]
    warm_sum = sum(w for _, w, _ in apart)
    cold_sum = sum(c for _, _, c in apart)
    rows.insert(
        _STEPS, ["sum of 1-7 timed apart", f"{warm_sum * 1e6:.1f}", f"{cold_sum * 1e6:.1f}", ""]
    )
    _, whole_warm, whole_cold = measured[_STEPS]  # 1-7 in a row
    return "\n".join(
        [
            "## Cold and warm cost of the chat path's own steps (bench/cold_path.py)",
            "",
            f"Machine: {machine()}. Command: `{command()}`; {args.repeats} alternations of "
            f"a cold call (after copying {evict.size // 1024**2} MiB) and a warm one, "
            "medians.",
            "",
            table(["step", "warm µs", "cold µs", "cold / warm"], rows),
            "",
            f"With the caches cold, the seven steps in a row took {whole_cold * 1e6:.0f} µs "
            f"against {whole_warm * 1e6:.0f} µs warm ({whole_cold / whole_warm:.1f} times). "
            "At concurrency 1 the upstream's latency separates the two halves of every "
            "call, and on a machine whose caches do not keep an idle process's lines "
            "for that long (a shared or virtual one), each half starts cold: there, "
            "the proxy overhead is set more by how much code and data a call touches "
            "than by how many instructions it runs. These steps are part of that "
            "overhead; the HTTP server, the provider's transport, routing, "
            "failover and metrics are the rest (section a. of the service bench measures "
            "the whole).",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "cold-path", text)


if __name__ == "__main__":
    main()
