"""The service bench's processes (fixed upstream, `chatroute serve`) and the config it generates."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench._common import REPO, local_env

BENCH_KEY_ENV = "CHATROUTE_BENCH_PROVIDER_KEY"


# ------------------------------------------------------------------------------ processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _service_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CHATROUTE_API_KEYS", None)  # /v1 open: no auth in the measured path
    env[BENCH_KEY_ENV] = "bench-key"  # the Anthropic provider sends a key, as a real one does
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return local_env(env)


@contextmanager
def running(
    argv: list[str], *, log: Path, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """Run a child process (its own process group), stopping it on exit; `env` adds to
    the environment it gets."""
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            env={**_service_env(), **(env or {})},
            cwd=REPO,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def start_upstream(stack: ExitStack, args: argparse.Namespace, workdir: Path) -> int:
    argv = [
        sys.executable,
        str(REPO / "bench" / "_fixed_upstream.py"),
        "--port",
        "0",
        "--delay-ms",
        str(args.delay_ms),
        "--chunks",
        "8",
        "--chunk-delay-ms",
        "1",
    ]
    proc = stack.enter_context(running(argv, log=workdir / "upstream.log"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        raise RuntimeError(f"the fixed upstream did not start: {line!r}")
    return int(line.split()[1])


def chatroute_argv(config: Path) -> list[str]:
    script = Path(sys.executable).with_name("chatroute")
    if script.exists():
        return [str(script), "serve", "--config", str(config)]
    code = "import sys; from chatroute.cli import main; sys.argv[0] = 'chatroute'; main()"
    return [sys.executable, "-c", code, "serve", "--config", str(config)]


def start_service(stack: ExitStack, config: Path, port: int, workdir: Path) -> int:
    proc = stack.enter_context(running(chatroute_argv(config), log=workdir / "service.log"))
    deadline = time.monotonic() + 600
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = (workdir / "service.log").read_text(encoding="utf-8")[-3000:]
                raise RuntimeError(f"the service exited ({proc.returncode}):\n{log}")
            try:
                if client.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    return proc.pid
            except httpx.TransportError:
                pass
            time.sleep(0.25)
    raise RuntimeError("the service did not become ready within 600 s")


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far; nan without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


# ---------------------------------------------------------------------------------- config


def provider_config(upstream_port: int, kind: str = "openai") -> dict[str, Any]:
    """The provider on the fixed upstream: OpenAI-compatible, or Anthropic's Messages API."""
    if kind == "anthropic":
        return {
            "type": "anthropic",
            "base_url": f"http://127.0.0.1:{upstream_port}",
            "model": "fixed-model",
            "api_key_env": BENCH_KEY_ENV,
        }
    return {
        "type": "openai",
        "base_url": f"http://127.0.0.1:{upstream_port}/v1",
        "model": "fixed-model",
    }


def make_config(
    data: dict[str, list[tuple[str, str]]],
    upstream_port: int,
    port: int,
    per_route: int,
    provider: str = "openai",
) -> dict[str, Any]:
    utterances: dict[str, list[str]] = {}
    for text, intent in data["train"]:
        bucket = utterances.setdefault(intent, [])
        if len(bucket) < per_route:
            bucket.append(text)
    routes: dict[str, Any] = {
        intent: {"utterances": texts, "targets": ["fixed"]}
        for intent, texts in sorted(utterances.items())
    }
    routes["general"] = {"targets": ["fixed"]}
    return {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "log_level": "warning",
            "max_classify_inputs": 4096,
        },
        "embedder": {"model": "default", "device": "cpu"},
        "routing": {
            "top_k": 5,
            "aggregation": "mean",
            "threshold": 0.3,
            "default_route": "general",
        },
        "providers": {"fixed": provider_config(upstream_port, provider)},
        "routes": routes,
    }


# -------------------------------------------------------------------- the service's stack


def uvicorn_stack() -> str:
    parts = []
    for name in ("uvloop", "httptools"):
        try:
            __import__(name)
            parts.append(f"{name} available")
        except ImportError:
            parts.append(f"no {name}")
    return ", ".join(parts)


def uvicorn_version() -> str:
    import uvicorn

    return str(uvicorn.__version__)
