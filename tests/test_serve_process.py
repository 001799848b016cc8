"""The real `chatroute serve` process: SIGHUP reloads its config, and with JSON logs every
line it writes is one JSON object, the request line included.

One process serves the module (starting it loads the model): the reload test runs first;
the log test, last, ends the process so that its shutdown lines are checked too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from chatroute.server.request_log import key_hash
from tests.fakes import FakeUpstream

KEY = "serve-key-0123456789"
SECRET = "sk-primary-secret-42"
ROOT = Path(__file__).resolve().parent.parent


def config(urls: dict[str, str], extra_route: str) -> dict[str, Any]:
    def provider(name: str) -> dict[str, Any]:
        return {
            "base_url": urls[name],
            "model": f"{name}-model",
            "api_key_env": f"{name.upper()}_KEY",
        }

    return {
        "server": {"port": 0, "log_format": "json"},
        "embedder": {"device": "cpu"},
        "routing": {"default_route": "chain", "threshold": 0.3},
        "providers": {name: provider(name) for name in ("primary", "fallback")},
        "routes": {
            "chain": {"targets": ["primary", "fallback"], "utterances": ["hello there"]},
            extra_route: {"targets": ["fallback"], "utterances": ["what is the weather like"]},
        },
    }


class Served:
    """A `chatroute serve` process and the lines of its stderr, read as they come."""

    def __init__(self, path: Path, urls: dict[str, str]) -> None:
        self.path = path
        self.urls = urls
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        env.update(CHATROUTE_API_KEYS=KEY, PRIMARY_KEY=SECRET)
        env.pop("CHATROUTE_ADMIN_KEY", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "chatroute", "serve", "--config", str(path)],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self.wait_line(lambda d: str(d.get("message", "")).startswith("ready:"), 180)
        self.base = f"http://127.0.0.1:{int(str(ready['message']).rsplit(':', 1)[1])}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_line(self, match: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The first JSON line that `match`es, waiting up to `timeout` s for it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if line.startswith("{") and match(json.loads(line)):
                        return dict(json.loads(line))
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    raise AssertionError("no such line in:\n" + "\n".join(self.lines))
                self._changed.wait(min(left, 1.0))

    def routes(self) -> list[str]:
        try:
            answer = httpx.get(f"{self.base}/readyz", timeout=2)
        except httpx.TransportError:
            return []
        return list(answer.json().get("routes", [])) if answer.status_code == 200 else []

    def stop(self) -> None:
        """End the process (SIGTERM) and read its last lines."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(30)
        self._reader.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with FakeUpstream() as primary, FakeUpstream() as fallback:
        urls = {"primary": primary.base_url, "fallback": fallback.base_url}
        path = tmp_path_factory.mktemp("serve") / "chatroute.yaml"
        path.write_text(yaml.safe_dump(config(urls, "old-only")), encoding="utf-8")
        process = Served(path, urls)
        try:
            yield process
        finally:
            process.stop()


def _wait(predicate: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


def test_sighup_reloads_the_serving_process(served: Served) -> None:
    assert served.process.poll() is None, "the served process ended before this test"
    assert served.routes() == ["chain", "old-only"]
    served.path.write_text(yaml.safe_dump(config(served.urls, "new-only")), encoding="utf-8")
    served.process.send_signal(signal.SIGHUP)
    _wait(lambda: served.routes() == ["chain", "new-only"], "the reload", 60)
    assert served.process.poll() is None  # SIGHUP reloads; it does not end the process
    served.wait_line(lambda d: "config reloaded" in str(d.get("message", "")), 10)


def test_serve_with_json_logs_writes_only_json_lines_and_the_request_line(
    served: Served,
) -> None:
    answer = httpx.post(
        f"{served.base}/v1/chat/completions",
        json={"model": "chain", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {KEY}", "x-request-id": "json-1"},
        timeout=30,
    )
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "json-1"
    request = served.wait_line(lambda d: d.get("request_id") == "json-1", 30)
    assert request["message"] == "request" and request["logger"] == "chatroute.requests"
    assert request["route"] == "chain" and request["status"] == 200
    assert request["attempts"][0]["provider"] == "primary"
    assert request["key"] == key_hash(KEY)
    served.stop()  # the shutdown's lines are checked too
    lines = served.lines
    summary = next(json.loads(x)["startup"] for x in lines if '"startup"' in x)
    assert summary["providers"]["primary"]["key"] == "set"
    assert summary["routes"]["chain"]["failover"] == ["primary", "fallback"]
    records = [line for line in lines if line.strip()]
    assert all(json.loads(line) for line in records)  # every line is one JSON object
    assert any(json.loads(line)["logger"].startswith("uvicorn") for line in records)
    assert not any(KEY in line or SECRET in line for line in records)
