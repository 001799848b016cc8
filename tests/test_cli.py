"""The `chatroute` command line: route, classify (with resume), fit, index build, config errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from classify_helpers import CONFIG
from typer.testing import CliRunner

from chatroute.chat import EmbeddingGenerator
from chatroute.cli import app
from chatroute.cli.classify import parse_input_line, resume_point

runner = CliRunner()


def run(*args: str) -> Any:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_help_lists_the_commands() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("serve", "route", "classify", "fit", "index"):
        assert command in result.output


def test_route_prints_the_decision(config_file: Path) -> None:
    result = run("route", "--config", config_file, "please solve this equation: 2x + 1 = 7")
    assert result.exit_code == 0, result.output
    decision = json.loads(result.stdout)
    assert decision["route"] == "math" and decision["is_default"] is False
    assert decision["scores"]["math"] == decision["score"]
    assert decision["matches"][0]["route"] == "math"


def test_bad_config_names_the_key_and_exits_2(tmp_path: Path) -> None:
    broken = json.loads(json.dumps(CONFIG))
    broken["routes"]["code"]["targets"] = ["q"]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(broken), encoding="utf-8")
    result = run("route", "--config", path, "hello")
    assert result.exit_code == 2
    assert "routes.code.targets[0]: unknown provider 'q'" in result.output


INPUT_LINES = [
    json.dumps("my python program crashes with an exception"),
    json.dumps({"id": "a", "input": "compute the integral of x cubed"}),
    "{not json",
    json.dumps({"messages": [{"role": "user", "content": "hello, how are you today"}]}),
    "",
    json.dumps({"foo": 1}),
    json.dumps({"input": 3}),
    json.dumps({"id": 7, "input": "write a function that reverses a string"}),
    json.dumps(""),
]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_classify_file_reports_bad_lines_and_writes_one_record_per_input(
    config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(INPUT_LINES) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    result = run(
        "classify",
        "-c",
        config_file,
        source,
        "-o",
        out,
        "--batch-size",
        2,
        "--scores",
        "--max-bad",
        3,
    )
    assert result.exit_code == 0, result.output
    records = read_jsonl(out)
    assert [r["line"] for r in records] == [1, 2, 4, 8, 9]
    assert [r["route"] for r in records] == ["code", "math", "general", "code", "general"]
    assert records[1]["id"] == "a" and records[3]["id"] == 7 and "id" not in records[0]
    assert records[4]["is_default"] is True and records[4]["score"] is None
    assert set(records[0]) >= {"route", "score", "scores", "is_default"}
    assert f"{source}:3: skipped: not valid JSON" in result.output
    assert f"{source}:6: skipped" in result.output
    assert f"{source}:7: skipped: 'input' must be a string" in result.output
    assert f"{source}:5:" not in result.output  # a blank line is not a bad one
    assert "classified 5 inputs" in result.output


def test_classify_resumes_after_an_interrupted_run(config_file: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(INPUT_LINES) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert run("classify", "-c", config_file, source, "-o", out, "--max-bad", 3).exit_code == 0
    complete = out.read_text()
    # An interrupted run: two records, then half of the third, and a record that says so.
    lines = complete.splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[2][:12])
    assert resume_point(out) == 2
    assert out.read_text() == lines[0] + lines[1]  # the partial line was cut off
    out.write_text(lines[0] + lines[1] + "not a record\n")  # a complete line, not ours
    assert resume_point(out) == 2  # the last record before it counts
    out.write_text(lines[0] + lines[1])
    # The record beside the output says the run did not finish.
    manifest = out.with_name(out.name + ".classify.json")
    manifest.write_text(manifest.read_text().replace('"complete": true', '"complete": false'))
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress", "--max-bad", 3)
    assert result.exit_code == 0, result.output
    assert "resumed after line 2" in result.output
    _same_records(out.read_text(), complete)  # nothing lost, nothing duplicated
    again = run("classify", "-c", config_file, source, "-o", out, "--no-progress")
    assert "classified 0 inputs" in again.output
    _same_records(out.read_text(), complete)


def _same_records(got: str, expected: str) -> None:
    """The same records in the same order; scores agree to float32 precision (a row's
    embedding differs in its last bits with the batch it was embedded in)."""
    rows = [json.loads(line) for line in got.splitlines()]
    want = [json.loads(line) for line in expected.splitlines()]
    assert [{**r, "score": None} for r in rows] == [{**r, "score": None} for r in want]
    for row, other in zip(rows, want, strict=True):
        assert (row["score"] is None) == (other["score"] is None)
        if row["score"] is not None:
            assert row["score"] == pytest.approx(other["score"], abs=1e-5)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('"plain text"', ("plain text", None)),
        ('{"input": "x", "id": 3}', ("x", 3)),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
            '"content": "b"}, {"role": "developer", "content": "c"}]}',
            ("a", None),
        ),
        ('{"messages": [{"role": "system", "content": "only system"}]}', ("", None)),
    ],
)
def test_input_lines_parse(line: str, expected: tuple[str, Any]) -> None:
    assert parse_input_line(line) == expected


@pytest.mark.parametrize(
    "line", ["[1, 2]", "3", '{"messages": [{"role": "alien", "content": "x"}]}', '{"x": 1}']
)
def test_bad_input_lines_raise_value_error(line: str) -> None:
    with pytest.raises(ValueError):
        parse_input_line(line)


def test_fit_writes_thresholds_the_config_can_use(config_file: Path, tmp_path: Path) -> None:
    labelled = tmp_path / "labelled.jsonl"
    rows = [
        {"input": "my code throws an exception when I run it", "route": "code"},
        {"input": "sort this list in python for me", "route": "code"},
        {"input": "integrate x squared from zero to one", "route": "math"},
        {"input": "solve for y in 2y = 10", "route": "math"},
        {"input": "how do I fix a flat bicycle tyre", "route": None},
        {"input": "solve my scheduling problem at work", "route": None},
        {"input": "write a wedding speech", "route": None},
        {"input": "bogus", "route": "nonexistent"},
    ]
    labelled.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    thresholds = tmp_path / "thresholds.json"
    result = run("fit", "-c", config_file, labelled, "-o", thresholds)
    assert result.exit_code == 0, result.output
    assert "unknown route 'nonexistent'" in result.output
    assert "overall accuracy" in result.output
    document = json.loads(thresholds.read_text())
    assert set(document["thresholds"]) <= {"code", "math", "general"}
    assert document["thresholds"] and document["report"]["after"]["examples"] == 7
    assert document["scoring"] == "prototype"
    assert document["oos_score"] in ("prototype", "centroid", "nearest", "blend")
    # The config picks the file up: routing then uses the fitted per-route thresholds.
    config = yaml.safe_load(config_file.read_text())
    config["routing"]["thresholds_file"] = "thresholds.json"
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    routed = run("route", "-c", config_file, "solve this equation for x")
    assert routed.exit_code == 0, routed.output
    assert json.loads(routed.stdout)["route"] == "math"


def test_index_build_persists_the_profile_index(config_file: Path, tmp_path: Path) -> None:
    target = tmp_path / "index"
    result = run("index", "build", "-c", config_file, "-o", target)
    assert result.exit_code == 0, result.output
    assert "7 utterances" in result.output
    assert "scoring prototype: head trained in" in result.output
    saved = sorted(p.name for p in target.iterdir())
    assert "head.npz" in saved  # the service's default mode trains and saves its head
    assert saved  # the vectors and their manifest
    config = yaml.safe_load(config_file.read_text())
    config["routing"]["index_path"] = "index"
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    routed = run("route", "-c", config_file, "fix the bug in my python code")
    assert routed.exit_code == 0, routed.output
    assert json.loads(routed.stdout)["route"] == "code"
    assert sorted(p.name for p in target.iterdir()) == saved


@pytest.mark.parametrize(
    ("proxies", "honoured"), [(None, False), (["10.0.0.0/8", "127.0.0.1"], True)]
)
def test_serve_runs_uvicorn_on_the_guarded_protocol_and_trusts_only_named_proxies(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    default_embedder: Callable[[], EmbeddingGenerator],
    proxies: list[str] | None,
    honoured: bool,
) -> None:
    from chatroute.server.connection import GuardedHttpProtocol

    settings = dict(CONFIG, server={"port": 8123, "log_level": "warning", "head_timeout": 4})
    if proxies is not None:
        settings["server"] = {**settings["server"], "forwarded_allow_ips": proxies}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        "chatroute.server.startup.run_server", lambda app, **kwargs: seen.update(kwargs, app=app)
    )
    monkeypatch.setattr("chatroute.engine.build_embedder", lambda config: default_embedder())
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # serve sets it; restored after
    result = run("serve", "--config", path)
    assert result.exit_code == 0, result.output
    assert issubclass(seen["http"], GuardedHttpProtocol) and seen["http"].head_timeout == 4
    assert seen["port"] == 8123
    assert seen["server_header"] is False and seen["access_log"] is False
    assert seen["proxy_headers"] is honoured
    assert seen["forwarded_allow_ips"] == proxies


# ---------------------------------------------------------------------------- check


def _write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_check_shows_providers_routes_and_keys_without_loading_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_model(config: Any) -> Any:
        raise AssertionError("check must not load the embedding model")

    monkeypatch.setattr("chatroute.engine.build_embedder", no_model)
    monkeypatch.setenv("SET_KEY", "sk-never-printed-0123456789")
    monkeypatch.delenv("UNSET_KEY", raising=False)
    config = {
        **CONFIG,
        "providers": {
            "with_key": {
                "base_url": "http://127.0.0.1:9/v1",
                "model": "m",
                "api_key_env": "SET_KEY",
            },
            "missing": {
                "base_url": "http://127.0.0.1:9/v1",
                "model": "m",
                "api_key_env": "UNSET_KEY",
            },
        },
        "routes": {
            **CONFIG["routes"],
            "code": {**CONFIG["routes"]["code"], "targets": ["with_key", "missing"]},
            "math": {**CONFIG["routes"]["math"], "targets": ["missing"]},
            "general": {**CONFIG["routes"]["general"], "targets": ["with_key"]},
        },
    }
    result = run("check", "--config", _write(tmp_path, config), "--no-model")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "from SET_KEY" in out and "UNSET_KEY not set" in out
    assert "sk-never-printed" not in out
    assert "with_key → missing" in out and "general (default)" in out
    assert "config ok" in out


def test_check_probe_lists_each_providers_models_and_fails_on_an_unreachable_one(
    tmp_path: Path,
) -> None:
    from tests.fakes import FakeUpstream
    from tests.fakes.anthropic import FakeAnthropic

    with (
        FakeUpstream(models=["m-served"]) as openai_up,
        FakeAnthropic(models=["claude-x"]) as claude_up,
    ):
        providers = {
            "served": {"base_url": openai_up.base_url, "model": "m-served"},
            "unlisted": {"base_url": openai_up.base_url, "model": "m-other"},
            "claude": {"type": "anthropic", "base_url": claude_up.url, "model": "claude-x"},
        }
        routes = {"general": {"utterances": ["hi"], "targets": list(providers)}}
        config = {"routing": {"default_route": "general"}, "providers": providers, "routes": routes}
        path = _write(tmp_path, config)
        good = run("check", "--config", path, "--probe", "--no-model")
        providers["down"] = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
        routes["general"]["targets"].append("down")
        bad = run(
            "check", "-c", _write(tmp_path, config), "--probe", "--timeout", "5", "--no-model"
        )
        assert openai_up.attempts == 0 and claude_up.attempts == 0  # no chat call was made
    assert good.exit_code == 0, good.output
    assert "probe served: ok" in good.output and "lists m-served" in good.output
    assert "probe unlisted: ok" in good.output and "does not list m-other" in good.output
    assert "probe claude: ok" in good.output and "lists claude-x" in good.output
    assert bad.exit_code == 1
    assert "probe down: failed" in bad.output and "connection failed" in bad.output
