"""Proxy overhead of chatroute and of peer gateways on this machine, all in one run.

Run from the repository root, after `make peers` (which installs the peers outside the
project's environment), or all at once with `make bench-peers`:

    .venv/bin/python bench/peer_overhead.py [--pairs 600] [--no-write]

The figures other gateways publish come from their machines; this puts chatroute and
two of them on the same machine, the same fixed-latency upstream and the same calls:

- chatroute: `chatroute serve` from this tree, the request's route named as its model;
- LiteLLM's proxy (`litellm[proxy]`, in `.venv-peers`): one model entry on the upstream,
  a master key, its defaults otherwise;
- Portkey's AI gateway (`@portkey-ai/gateway`, Node, in `.peers/`): the upstream given as
  a custom host of the `openai` provider, in the request's headers, as its docs show.

Each rotation calls direct and every gateway once, in a fresh random order (a process
called right after another finds the code they share warm in the caches), at
concurrency 1, timed as section a. of bench/service_bench.py times them: to the full
answer, and to the first content token of a stream. It reports each gateway's added p50
over direct and the CPU its process used per request, and chatroute's added p50 as a
multiple of the fastest peer's, with a bootstrap interval over the run's rotations (the
noise within the run; the machine's drift between runs is wider). A gateway that fails
a mode is reported as failing, with the reason, and left out of that mode. The result
goes to the `peer-overhead` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import proxy_compare as pc
from bench import service_bench as sb
from bench._common import REPO, bench_main, command, machine, table

PEERS_VENV = REPO / ".venv-peers"
PEERS_NODE = REPO / ".peers"
PORTKEY_SERVER = (
    PEERS_NODE / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
)
MODEL = "general"  # chatroute's forced route, LiteLLM's model entry; Portkey passes it on


class Peer:
    """One gateway under test: how to start it and how to call it."""

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        self.pid: int | None = None
        self.url = ""
        self.headers: dict[str, str] = {}
        self.failure: dict[bool, str] = {}  # stream flag -> why that mode failed


def _litellm_version() -> str:
    meta = list((PEERS_VENV / "lib").glob("python*/site-packages/litellm-*.dist-info"))
    return meta[0].name.removesuffix(".dist-info").split("-")[1] if meta else "?"


def _portkey_version() -> str:
    package = PORTKEY_SERVER.parents[1] / "package.json"
    return str(json.loads(package.read_text(encoding="utf-8")).get("version", "?"))


def _wait_ready(
    peer: Peer, proc_poll: Callable[[], int | None], log: Path, deadline_s: float = 300.0
) -> None:
    """Wait until a plain chat call through `peer` answers 200 (the error quotes the end
    of its log when it does not)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    deadline = time.monotonic() + deadline_s
    last = ""
    with httpx.Client(timeout=10, headers=peer.headers) as client:
        while time.monotonic() < deadline:
            if proc_poll() is not None:
                tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(f"{peer.name} exited before it was ready:\n{tail}")
            try:
                response = client.post(peer.url, json=body)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.TransportError as exc:
                last = type(exc).__name__
            time.sleep(0.5)
    raise RuntimeError(f"{peer.name} was not ready within {deadline_s:g} s ({last})")


def start_litellm(stack: ExitStack, upstream: int, work: Path) -> Peer:
    peer = Peer("LiteLLM proxy", _litellm_version())
    key = "sk-" + secrets.token_hex(32)
    config = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": "openai/fixed-model",
                    "api_base": f"http://127.0.0.1:{upstream}/v1",
                    "api_key": "bench-key",
                },
            }
        ],
        "litellm_settings": {"telemetry": False},
    }
    path = work / "litellm.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    port = sb._free_port()
    argv = [
        str(PEERS_VENV / "bin" / "litellm"),
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    log = work / "litellm.log"
    env = {"LITELLM_MASTER_KEY": key, "LITELLM_LOG": "ERROR"}
    proc = stack.enter_context(sb.running(argv, log=log, env=env))
    peer.pid, peer.url = proc.pid, f"http://127.0.0.1:{port}/v1/chat/completions"
    peer.headers = {"authorization": f"Bearer {key}"}
    _wait_ready(peer, proc.poll, log)
    return peer


def start_portkey(stack: ExitStack, upstream: int, work: Path) -> Peer:
    peer = Peer("Portkey AI gateway", _portkey_version())
    port = sb._free_port()
    node = shutil.which("node") or "node"
    argv = [node, str(PORTKEY_SERVER), f"--port={port}", "--headless"]
    log = work / "portkey.log"
    proc = stack.enter_context(sb.running(argv, log=log, env={"NODE_ENV": "production"}))
    peer.pid, peer.url = proc.pid, f"http://127.0.0.1:{port}/v1/chat/completions"
    peer.headers = {
        "x-portkey-provider": "openai",
        "x-portkey-custom-host": f"http://127.0.0.1:{upstream}/v1",
        "authorization": "Bearer bench-key",
    }
    _wait_ready(peer, proc.poll, log)
    return peer


def start_chatroute(stack: ExitStack, upstream: int, work: Path) -> Peer:
    peer = Peer("chatroute", f"this tree ({pc.git('rev-parse', '--short', 'HEAD')})")
    peer.pid, peer.url = pc.start_tree(stack, REPO, upstream, work, "chatroute")
    return peer


def _probe(peer: Peer, stream: bool) -> str | None:
    """Why one call of this mode through `peer` fails, or None when it works."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": sb.QUESTION}], "stream": stream}
    ).encode()
    with httpx.Client(timeout=30, headers=peer.headers) as client:
        try:
            sb._timed_call(client, peer.url, body, stream)
        except (RuntimeError, httpx.HTTPError) as exc:
            return str(exc).splitlines()[0].removeprefix(f"{peer.url}: ")[:160]
    return None


BOOTSTRAP_DRAWS = 2000  # resamples of the rotations behind the ratio's interval


def ratio_to_fastest(
    times: Mapping[str, list[float]], ours: str = "chatroute", draws: int = BOOTSTRAP_DRAWS
) -> tuple[str, float, float, float] | None:
    """`ours`' added p50 over the fastest peer's (the lowest added p50) in the same run:
    (that peer, the ratio, and the 5th and 95th percentiles of the ratio over `draws`
    bootstrap resamples of the rotations, each rotation's calls drawn together). None
    without `ours` or a peer. The interval covers the noise within a run, not the
    machine's drift from one run to the next."""
    import numpy as np

    peers = [name for name in times if name not in ("direct", ours)]
    if ours not in times or not peers:
        return None
    arrays = {name: np.asarray(values) for name, values in times.items()}
    rotations = len(arrays["direct"])

    def added(name: str, picks: np.ndarray) -> np.ndarray:
        chosen = np.median(arrays[name][picks], axis=-1)
        return chosen - np.median(arrays["direct"][picks], axis=-1)

    everything = np.arange(rotations)
    fastest = min(peers, key=lambda name: float(added(name, everything)))
    ratio = float(added(ours, everything) / added(fastest, everything))
    picks = np.random.default_rng(0).integers(0, rotations, (draws, rotations))
    low, high = np.percentile(added(ours, picks) / added(fastest, picks), [5, 95])
    return fastest, ratio, float(low), float(high)


def run(args: argparse.Namespace) -> str:
    missing = [str(p) for p in (PEERS_VENV / "bin" / "litellm", PORTKEY_SERVER) if not p.exists()]
    if missing:
        raise SystemExit(f"peers not installed ({', '.join(missing)}): run `make peers` first")
    load_before = sb.loadavg()
    with tempfile.TemporaryDirectory(prefix="chatroute-peers-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        upstream = sb.start_upstream(stack, args, work)
        peers = [
            start_chatroute(stack, upstream, work),
            start_litellm(stack, upstream, work),
            start_portkey(stack, upstream, work),
        ]
        results: dict[tuple[str, bool], tuple[str, str]] = {}
        ratios: dict[bool, tuple[str, float, float, float] | None] = {}
        for stream in (False, True):
            arms: dict[str, tuple[int | None, str]] = {
                "direct": (None, f"http://127.0.0.1:{upstream}/v1/chat/completions")
            }
            headers: dict[str, Mapping[str, str]] = {}
            for peer in peers:
                failure = _probe(peer, stream)
                if failure is not None:
                    peer.failure[stream] = failure
                    continue
                arms[peer.name] = (peer.pid, peer.url)
                headers[peer.name] = peer.headers
            samples: dict[str, list[float]] = {}
            for name, added, used in pc.compare(arms, args.pairs, stream, headers, samples):
                results[(name, stream)] = (added, used)
                print(f"{name} | {'first token' if stream else 'full answer'} | {added} | {used}")
            ratios[stream] = ratio_to_fastest(samples)
    rows = []
    for peer in peers:
        row = [peer.name, peer.version]
        for stream in (False, True):
            if (peer.name, stream) in results:
                row += list(results[(peer.name, stream)])
            else:
                row += [f"failed: {peer.failure.get(stream, '?')}", ""]
        rows.append(row)
    lines = [
        "## Proxy overhead of chatroute and peer gateways, one run on this machine",
        "",
        f"- Machine: {machine()}; load average {load_before} before, {sb.loadavg()} after.",
        f"- Command: `{command()}`",
        f"- One fixed {args.delay_ms:g} ms upstream (`bench/_fixed_upstream.py`), concurrency 1;"
        f" {args.pairs} rotations per mode of direct and each gateway, each rotation in a"
        " fresh random order. Added = the gateway's p50 minus direct's p50; CPU = the"
        " gateway process's CPU time per request (per stream for the first-token mode).",
        "",
        table(
            [
                "gateway",
                "version",
                "full answer: added p50 ms",
                "CPU ms/req",
                "first token: added p50 ms",
                "CPU ms/stream",
            ],
            rows,
        ),
    ]
    notes = []
    for stream, found in ratios.items():
        if found is not None:
            fastest, ratio, low, high = found
            notes.append(
                f"- {'First token' if stream else 'Full answer'}: chatroute's added p50 is"
                f" {ratio:.3f}x the fastest peer's ({fastest}); 90% interval over this"
                f" run's rotations ({BOOTSTRAP_DRAWS:,} bootstrap resamples):"
                f" {low:.3f}-{high:.3f}x."
            )
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=600)
    bench_main(parser, run, "peer-overhead")


if __name__ == "__main__":
    main()
