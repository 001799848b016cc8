"""The soak's service: its config over the fake upstreams, run under uvicorn in a child process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench._common import local_env

# The soak routes' limits: generous, so that only injected faults (hang, stall, slow first
# token) hit them, not a service that is merely busy.
FIRST_TOKEN_TIMEOUT = 5.0
STALL_TIMEOUT = 5.0
# The silent primary of the failover measurement.
FAILOVER_FIRST_TOKEN_TIMEOUT = 1.0

SERVE = (
    "import sys, uvicorn\n"
    "from chatroute.config import load_config\n"
    "from chatroute.server import create_app\n"
    "from chatroute.server.connection import http_protocol\n"
    "uvicorn.run(create_app(load_config(sys.argv[1])), host='127.0.0.1', port=int(sys.argv[2]),"
    " log_level='error', timeout_keep_alive=30, backlog=4096, http=http_protocol())\n"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def service_config(urls: dict[str, str]) -> dict[str, Any]:
    def provider(name: str, first_token: float = FIRST_TOKEN_TIMEOUT) -> dict[str, Any]:
        return {
            "base_url": urls[name],
            "model": f"{name}-model",
            "timeouts": {
                "connect": 2,
                "attempt": 60,
                "first_token": first_token,
                "stall": STALL_TIMEOUT,
            },
            "max_connections": 1000,
        }

    return {
        "server": {"log_level": "error"},
        "embedder": {"model": "default", "device": "cpu"},
        "routing": {"default_route": "a", "threshold": 0.3},
        "resilience": {"deadline": 120, "breaker": {"minimum_requests": 20}},
        "providers": {
            **{name: provider(name) for name in ("p1", "p2", "p3")},
            "dead": provider("dead", FAILOVER_FIRST_TOKEN_TIMEOUT),
            "spare": provider("spare"),
        },
        "routes": {
            "a": {"targets": ["p1", "p2", "p3"], "max_attempts": 3, "utterances": ["hello"]},
            "b": {"targets": ["p2", "p3", "p1"], "max_attempts": 2},
            "c": {"targets": ["p3", "p1"], "retry_same_provider": True, "max_attempts": 3},
            "failover": {"targets": ["dead", "spare"]},
            "dead_only": {"targets": ["dead"]},
        },
    }


class Service:
    """The service in a child process."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="chatroute-soak-")
        path = Path(self.dir.name) / "chatroute.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = local_env({**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        self.log = open(Path(self.dir.name) / "service.log", "w+b")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(path), str(self.port)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError("the service exited:\n" + self.log.read().decode()[-3000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError("the service did not get ready")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.process.pid}/status", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        return float("nan")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def cpu_seconds(self) -> float:
        """User + system CPU time the service process has used."""
        with open(f"/proc/{self.process.pid}/stat", encoding="utf-8") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.log.close()
        self.dir.cleanup()
