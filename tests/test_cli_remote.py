"""`chatroute route --url`: decisions asked of a real running service, stdin, errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from classify_helpers import CONFIG
from typer.testing import CliRunner

from chatroute.chat import EmbeddingGenerator
from chatroute.cli import app
from chatroute.config import parse_config
from chatroute.server import create_app

KEY = "cli-key-0123456789"
runner = CliRunner()


def run(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, list(args), input=input, env=env, catch_exceptions=False)


@pytest.fixture(scope="module")
def service(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Callable[..., Any]
) -> Iterator[str]:
    config = parse_config(CONFIG, environ={})
    service_app = create_app(config, api_keys=[KEY], environ={}, embedder=default_embedder())
    with serve_app(service_app) as url:
        yield url


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _same(remote: dict[str, Any], local: dict[str, Any]) -> None:
    assert remote["route"] == local["route"] and remote["is_default"] == local["is_default"]
    # The learned head is trained on the profile embeddings, which differ in the last bits
    # with how the utterances were batched: scores agree to a few 1e-4, not bit for bit.
    assert remote["score"] == pytest.approx(local["score"], abs=2e-3)
    assert remote["scores"].keys() == local["scores"].keys()
    assert [m["utterance"] for m in remote["matches"]] == [m["utterance"] for m in local["matches"]]


def test_the_service_answers_as_the_local_model_does(service: str, config_file: Path) -> None:
    text = "please solve this equation: 2x + 1 = 7"
    remote = run("route", "--url", service, "--api-key", KEY, text)
    assert remote.exit_code == 0, remote.output
    local = run("route", "--config", str(config_file), text)
    assert local.exit_code == 0, local.output
    decision = json.loads(remote.output)
    assert decision["route"] == "math"
    _same(decision, json.loads(local.output))


def test_stdin_texts_one_json_line_each_with_the_key_from_the_environment(
    service: str, config_file: Path
) -> None:
    texts = "my program crashes with an exception\n\nwhat is the integral of x squared\nhi\n"
    remote = run(
        "route", "--url", f"{service}/v1/", "-", input=texts, env={"CHATROUTE_API_KEY": KEY}
    )
    assert remote.exit_code == 0, remote.output
    records = [json.loads(line) for line in remote.output.splitlines()]
    assert [r["input"] for r in records] == [
        "my program crashes with an exception",
        "what is the integral of x squared",
        "hi",
    ]
    assert [r["route"] for r in records][:2] == ["code", "math"]
    local = run("route", "-c", str(config_file), "-", input=texts)
    assert local.exit_code == 0, local.output
    for mine, theirs in zip(records, map(json.loads, local.output.splitlines()), strict=True):
        assert mine["input"] == theirs["input"]
        _same(mine, theirs)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--api-key", "wrong"], "refused the API key (401)"),
        ([], "refused the API key (401)"),
    ],
)
def test_a_refused_key_is_one_line_and_exit_2(service: str, args: list[str], fragment: str) -> None:
    result = run("route", "--url", service, *args, "hello", env={"CHATROUTE_API_KEY": ""})
    assert result.exit_code == 2
    assert fragment in result.output and len(result.output.strip().splitlines()) == 1


def test_a_refused_request_names_the_service_message(service: str) -> None:
    result = run("route", "--url", service, "--api-key", KEY, "x" * 1_000_001)
    assert result.exit_code == 2
    assert "answered 400" in result.output and "at most 1000000 characters" in result.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--url", "localhost:8080"], "--url must look like http://host:port"),
        (["--url", "http://127.0.0.1:notaport"], "is not a URL"),
        ([], "give --config FILE"),
        (["--url", "http://127.0.0.1:1", "--config", "x.yaml"], "give --config FILE"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    result = run("route", *args, "hello")
    assert result.exit_code == 2
    assert fragment in result.output and len(result.output.strip().splitlines()) == 1


def test_an_unreachable_service_is_one_line_exit_2_no_traceback() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, *sys.path])}
    script = "from chatroute.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", script, "route", "--url", url, "hi"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("error: cannot reach the chatroute service at " + url)
