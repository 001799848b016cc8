"""Live reload of the config file over real sockets: streams in flight finish on the old
config, new requests see the new routes, a bad config is refused and the old one serves on."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from typer.testing import CliRunner

from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.cli.app import app as cli
from chatroute.config import load_config
from chatroute.server import create_app
from tests.fakes import FakeUpstream, Ok

ADMIN = "admin-key-0123456789"
WORDS = " ".join(f"w{i}" for i in range(30))


def config(urls: dict[str, str], routes: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "routing": {"default_route": next(iter(routes)), "threshold": 0.2},
        "providers": {n: {"base_url": u, "model": f"{n}-model"} for n, u in urls.items()},
        "routes": routes,
        **extra,
    }


OLD_ROUTES = {
    "code": {"targets": ["primary"], "utterances": ["write a python function", "fix my bug"]},
    "old-only": {"targets": ["primary"], "utterances": ["tell me a joke"]},
}
NEW_ROUTES = {
    "code": {"targets": ["fallback"], "utterances": ["write a python function", "fix my bug"]},
    "new-only": {"targets": ["fallback"], "utterances": ["what is the weather like"]},
}


class Running:
    def __init__(self, url: str, app: Any, path: Path, ups: dict[str, FakeUpstream]) -> None:
        self.url = url
        self.app = app
        self.path = path
        self.upstreams = ups
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)

    def write(self, routes: dict[str, Any], **extra: Any) -> None:
        urls = {n: u.base_url for n, u in self.upstreams.items()}
        self.path.write_text(yaml.safe_dump(config(urls, routes, **extra)), encoding="utf-8")

    def reload(self, key: str | None = ADMIN) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}/admin/reload", headers=headers, timeout=120)

    def models(self) -> list[str]:
        return [m.id for m in self.client.models.list().data]


@pytest.fixture
def running(
    tmp_path: Path,
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> Iterator[Running]:
    path = tmp_path / "chatroute.yaml"
    with FakeUpstream() as primary, FakeUpstream() as fallback:
        ups = {"primary": primary, "fallback": fallback}
        path.write_text(
            yaml.safe_dump(config({n: u.base_url for n, u in ups.items()}, OLD_ROUTES)),
            encoding="utf-8",
        )
        env = {"CHATROUTE_ADMIN_KEY": ADMIN}
        app = create_app(
            load_config(path, environ=env),
            environ=env,
            embedder=default_embedder(),
            config_path=path,
        )
        with serve_app(app) as url:
            yield Running(url, app, path, ups)


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.02)


def test_a_stream_finishes_on_the_old_config_while_new_requests_see_the_new(
    running: Running,
) -> None:
    resume = threading.Event()  # the stream pauses after its first word until the reload is done
    running.upstreams["primary"].default = Ok(WORDS, paused_after=1, resume=resume)
    old_engine = running.app.state.service.engine
    raw = running.client.chat.completions.with_raw_response.create(
        model="old-only", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    assert raw.headers["x-chatroute-provider"] == "primary"
    stream = raw.parse()
    chunks = iter(stream)
    first = next(c for c in chunks if c.choices and c.choices[0].delta.content)
    head = first.choices[0].delta.content or ""
    assert head.split() == ["w0"]

    running.write(NEW_ROUTES)
    answer = running.reload()
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["routes"] == ["code", "new-only"]
    assert report["embedder"] == "reused"
    assert report["draining"] == 1  # the stream above, still running

    # New requests: the new routes and failover order.
    assert running.models()[:3] == ["auto", "code", "new-only"]
    with pytest.raises(openai.NotFoundError):
        running.client.chat.completions.create(
            model="old-only", messages=[{"role": "user", "content": "hi"}]
        )
    fresh = running.client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "write a python function"}]
    )
    assert fresh.headers["x-chatroute-route"] == "code"
    assert fresh.headers["x-chatroute-provider"] == "fallback"

    # The stream in flight was not cut: it ends on the old config's provider.
    assert not old_engine.providers["primary"]._closed  # closed only after the stream
    resume.set()
    rest = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (head + rest).split() == WORDS.split()
    assert running.upstreams["primary"].attempts == 1
    _wait(lambda: old_engine.providers["primary"]._closed, "closing the old engine")
    assert running.app.state.service.engine is not old_engine


def test_metrics_name_the_scoring_mode_the_reloaded_config_runs(running: Running) -> None:
    def scoring_lines() -> list[str]:
        text = httpx.get(f"{running.url}/metrics", timeout=10).text
        return [line for line in text.splitlines() if line.startswith("chatroute_scoring_")]

    assert 'chatroute_scoring_info{mode="prototype"} 1.0' in scoring_lines()
    running.write(OLD_ROUTES, routing={"default_route": "code", "scoring": "knn"})
    answer = running.reload()
    assert answer.status_code == 200, answer.text
    assert answer.json()["scoring"] == "knn" and answer.json()["training_seconds"] == 0
    lines = scoring_lines()
    assert 'chatroute_scoring_info{mode="knn"} 1.0' in lines
    assert not any('mode="prototype"' in line for line in lines)
    assert "chatroute_scoring_training_seconds 0.0" in lines  # knn does not train


def test_a_bad_config_is_refused_and_the_old_one_serves_on(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    running.path.write_text("routes: [unclosed\n", encoding="utf-8")
    answer = running.reload()
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert "not valid YAML" in error["message"]
    assert "the old config keeps serving" in error["message"]

    running.write({"code": {"targets": ["nowhere"], "utterances": ["x"]}})
    answer = running.reload()
    assert answer.status_code == 422
    problems = answer.json()["error"]["problems"]
    assert any("nowhere" in p["problem"] or "nowhere" in p["where"] for p in problems)
    assert "reload refused" in caplog.text

    assert running.models()[:3] == ["auto", "code", "old-only"]
    done = running.client.chat.completions.create(
        model="old-only", messages=[{"role": "user", "content": "hi"}]
    )
    assert done.choices[0].message.content


def test_the_admin_endpoint_needs_the_admin_key(running: Running) -> None:
    assert running.reload(key=None).status_code == 401
    assert running.reload(key="k").status_code == 401  # an API key is not the admin key
    assert running.reload(key=ADMIN + "x").status_code == 401


def test_chatroute_reload_asks_the_running_service(running: Running) -> None:
    runner = CliRunner()
    refused = runner.invoke(cli, ["reload", "--url", running.url, "--admin-key", "wrong"])
    assert refused.exit_code == 2
    assert "refused the admin key" in refused.output
    running.write(NEW_ROUTES)
    done = runner.invoke(cli, ["reload", "--url", running.url, "--admin-key", ADMIN])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["routes"] == ["code", "new-only"]
    running.path.write_text("routing: {default_route: nowhere}\n", encoding="utf-8")
    bad = runner.invoke(cli, ["reload", "--url", running.url, "--admin-key", ADMIN])
    assert bad.exit_code == 2
    assert "did not reload (422)" in bad.output
    assert running.models()[:3] == ["auto", "code", "new-only"]


def test_without_an_admin_key_there_is_no_admin_api(
    tmp_path: Path,
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> None:
    with FakeUpstream() as up:
        path = tmp_path / "c.yaml"
        routes = {"code": {"targets": ["primary"], "utterances": ["x"]}}
        data = config({"primary": up.base_url}, routes)
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        app = create_app(
            load_config(path, environ={}),
            environ={},
            embedder=default_embedder(),
            config_path=path,
        )
        with serve_app(app) as url:
            answer = httpx.post(f"{url}/admin/reload", headers={"authorization": "Bearer x"})
            assert answer.status_code == 404
            assert "admin API is off" in answer.json()["error"]["message"]


def test_a_new_embedder_rebuilds_everything_and_a_second_reload_meanwhile_is_refused(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="chatroute")
    running.write(NEW_ROUTES, embedder={"max_batch_size": 16})
    first: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: first.append(running.reload()))
    worker.start()
    _wait(lambda: bool(running.app.state.reloader.busy), "the first reload starting")
    second = running.reload()
    worker.join(120)
    assert second.status_code == 409
    assert "a reload is already running" in second.json()["error"]["message"]
    (answer,) = first
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["embedder"] == "rebuilt"
    assert any("the embedder changed" in note for note in report["notes"])
    assert "rebuilt" in caplog.text
    engine = running.app.state.service.engine
    assert engine.config.embedder.max_batch_size == 16
    served = running.client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "what is the weather like"}]
    )
    assert served.headers["x-chatroute-route"] == "new-only"
