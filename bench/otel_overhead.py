"""OpenTelemetry cost: the proxy overhead with tracing off and on, measured side by side.

Run: `.venv/bin/python bench/otel_overhead.py [--requests 300] [--chunks 20]
[--baseline-src DIR] [--no-write]`

Two services run in their own processes in front of one scripted fake upstream on
127.0.0.1 (as in bench/proxy_overhead.py): one with tracing off, one with
`OTEL_TRACES_EXPORTER=otlp` exporting every span over OTLP/HTTP (batched, as in
production) to a sink on 127.0.0.1 that answers 200. With `--baseline-src DIR` a third
service runs the code of another source tree (a checkout without tracing) for the
off-versus-before comparison. One client sends each request to every service in turn
(named route: no embedding), so the machine's noise falls on all of them alike; the
report gives p50 / p99 of the time to the first content byte and to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import os
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench._common import command, machine, pct, table
from bench._soak_service import Service
from bench.proxy_overhead import config, timed
from tests.fakes import FakeUpstream, Ok


class _Sink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that keeps nothing: 200 to every export."""

    received = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        type(self).received += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def start_service(cfg: dict[str, Any], env: dict[str, str]) -> Service:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return Service(cfg)
    finally:
        os.environ.clear()
        os.environ.update(saved)


async def measure(
    args: argparse.Namespace, services: dict[str, Service]
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for stream in (False, True):
            urls = {name: f"{s.url}/v1/chat/completions" for name, s in services.items()}
            for _ in range(20):
                for url in urls.values():
                    await timed(client, url, stream, "direct")
            rows: dict[str, list[tuple[float, float]]] = {name: [] for name in urls}
            for _ in range(args.requests):
                for name, url in urls.items():
                    rows[name].append(await timed(client, url, stream, "direct"))
            out["stream" if stream else "plain"] = rows
    return out


def report(args: argparse.Namespace, data: dict[str, Any], exports: int) -> str:
    ms = 1000.0
    names = list(data["plain"])
    rows = []
    for mode, label in (("plain", "non-streamed"), ("stream", f"streamed, {args.chunks} chunks")):
        for index, what in ((0, "first content"), (1, "end")):
            if mode == "plain" and index == 0:
                continue
            cells = [f"{label}: to the {what}"]
            for name in names:
                values = [r[index] for r in data[mode][name]]
                cells.append(f"{pct(values, 0.5) * ms:.2f} / {pct(values, 0.99) * ms:.2f}")
            off = pct([r[index] for r in data[mode]["off"]], 0.5)
            on = pct([r[index] for r in data[mode]["on"]], 0.5)
            cells.append(f"{(on - off) * ms:+.2f}")
            rows.append(tuple(cells))
    headers = ["request", *(f"{n} p50 / p99 ms" for n in names), "on - off p50 ms"]
    return "\n".join(
        [
            "## OpenTelemetry cost (bench/otel_overhead.py)",
            "",
            f"Command: `{command()}`",
            "",
            f"Machine: {machine()}. One client, {args.requests} requests per row in sequence, "
            "each sent to every service in turn (named route, fake upstream answering at "
            "once). `off`: tracing off (OTEL_SDK_DISABLED=true); `on`: OTEL_TRACES_EXPORTER=otlp over HTTP to "
            f"a local sink ({exports} batch exports received)"
            + (
                "; `before`: the baseline source tree, no tracing code."
                if "before" in names
                else "."
            ),
            "",
            table(headers, rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--baseline-src", type=Path, default=None)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    text = " ".join(f"w{i}" for i in range(args.chunks))
    here = str(Path(__file__).resolve().parent.parent)
    off_env = {"OTEL_SDK_DISABLED": "true", "PYTHONPATH": here}
    on_env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
        "OTEL_SDK_DISABLED": "false",
        "PYTHONPATH": here,
    }
    services: dict[str, Service] = {}
    with FakeUpstream(default=Ok(text)) as fake:
        cfg = config(fake.base_url)
        try:
            if args.baseline_src is not None:
                before = {"OTEL_SDK_DISABLED": "true", "PYTHONPATH": str(args.baseline_src)}
                services["before"] = start_service(cfg, before)
            services["off"] = start_service(cfg, off_env)
            services["on"] = start_service(cfg, on_env)
            for service in services.values():
                service.wait_ready()
            data = asyncio.run(measure(args, services))
        finally:
            for service in services.values():
                service.close()
    sink.shutdown()
    text = report(args, data, _Sink.received)
    print(text)
    if not args.no_write:
        path = Path(here) / "BENCHMARKS.md"
        current = path.read_text(encoding="utf-8")
        marker = "## OpenTelemetry cost (bench/otel_overhead.py)"
        if marker in current:
            head, _, tail = current.partition(marker)
            rest = tail.split("\n## ", 1)
            current = head + text + ("\n\n## " + rest[1] if len(rest) > 1 else "\n")
        else:
            current = current.rstrip("\n") + "\n\n" + text + "\n"
        path.write_text(current, encoding="utf-8")


if __name__ == "__main__":
    main()
