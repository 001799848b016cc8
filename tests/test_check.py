"""`chatroute check` runs every check the commands run; a user's error is one line and exit 2.

Each bad config is caught by `check` with its message, and the same config fails `serve`
(the real command line, in a subprocess) with the same lines, exit status 2 and no
traceback.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from chatroute.checks import PathError, index_folder_problem, input_file, output_file
from chatroute.cli import app
from chatroute.cli.errors import UserErrorGroup
from chatroute.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent

CONFIG: dict[str, Any] = {
    "server": {"port": 0},
    "routing": {"top_k": 3, "threshold": 0.25, "default_route": "general"},
    "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
    "routes": {
        "code": {"utterances": ["fix this bug in my python code"], "targets": ["p"]},
        "math": {"utterances": ["solve this equation for x"], "targets": ["p"]},
        "general": {"utterances": ["hello, how are you"], "targets": ["p"]},
    },
}


@dataclass(frozen=True)
class Case:
    """A config made bad in one way, and the line `check` and `serve` must print."""

    change: Callable[[dict[str, Any], Path], None]
    expected: str
    env: tuple[tuple[str, str], ...] = ()


def _set(path: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    def change(config: dict[str, Any], folder: Path) -> None:
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value(folder) if callable(value) else value

    return change


def _thresholds(table: dict[str, Any]) -> Callable[[dict[str, Any], Path], None]:
    def change(config: dict[str, Any], folder: Path) -> None:
        (folder / "thresholds.json").write_text(
            json.dumps({"format": "chatroute-thresholds/1", "thresholds": table})
        )
        config["routing"]["thresholds_file"] = "thresholds.json"

    return change


def _a_file(folder: Path) -> str:
    (folder / "not-an-index").write_text("hello\n")
    return "not-an-index"


def _a_folder_without_a_model(folder: Path) -> str:
    (folder / "empty-model").mkdir()
    (folder / "empty-model" / "README.md").write_text("no weights here\n")
    return str(folder / "empty-model")


CASES: dict[str, Case] = {
    "base_url without a scheme": Case(
        _set("providers.p.base_url", "127.0.0.1:8001/v1"),
        "providers.p.base_url: '127.0.0.1:8001/v1' has no scheme: "
        "write it as http://127.0.0.1:8001/v1",
    ),
    "base_url without a host": Case(
        _set("providers.p.base_url", "http:///v1"),
        "providers.p.base_url: 'http:///v1' names no host",
    ),
    "base_url_env holding no URL": Case(
        _set("providers.p.base_url_env", "CHECK_TEST_URL"),
        "providers.p.base_url_env: CHECK_TEST_URL in the environment: 'localhost:8001' has "
        "no scheme: write it as http://localhost:8001",
        env=(("CHECK_TEST_URL", "localhost:8001"),),
    ),
    "header value with CR/LF": Case(
        _set("providers.p.headers", {"X-Trace": "a\r\nX-Injected: 1"}),
        "providers.p.headers: header 'X-Trace': the value holds a line break or NUL "
        "(CR/LF injection)",
    ),
    "misspelled key": Case(
        _set("routing.treshold", 0.4),
        "routing.treshold: unknown key (did you mean 'threshold'?)",
    ),
    "missing thresholds_file": Case(
        _set("routing.thresholds_file", "nowhere.json"),
        "routing.thresholds_file: cannot read {folder}/nowhere.json: No such file or directory",
    ),
    "thresholds naming no route": Case(
        _thresholds({"code": 0.4, "cooking": 0.3}),
        "routing.thresholds_file.cooking: unknown route",
    ),
    "threshold out of range": Case(
        _thresholds({"code": 3}),
        "routing.thresholds_file.code: 3 in {folder}/thresholds.json is out of range: "
        "a threshold lies in [-1, 1] for mean aggregation",
    ),
    "index_path that is a file": Case(
        _set("routing.index_path", _a_file),
        "routing.index_path: {folder}/not-an-index: is a file, not a profile index folder",
    ),
    "embedder path that does not exist": Case(
        _set("embedder.model", "/no/such/model"),
        "embedder.model: could not load embedding model '/no/such/model': no such model folder",
    ),
    "embedder folder without a model": Case(
        _set("embedder.model", _a_folder_without_a_model),
        "embedder.model: '{folder}/empty-model' holds no sentence-transformers model "
        "(neither modules.json nor config.json)",
    ),
    "embedder batch_wait_ms out of range": Case(
        _set("embedder.batch_wait_ms", 5000),
        "embedder.batch_wait_ms: Input should be less than or equal to 1000",
    ),
    "embedder pack_width over the pass budget": Case(
        _set("embedder", {"model": "default", "max_batch_tokens": 256, "pack_width": 512}),
        "embedder.pack_width: 512 is over max_batch_tokens (256): a packed row must fit in "
        "one pass",
    ),
}


def _env(extra: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def _cli(*args: str, env: tuple[tuple[str, str], ...] = ()) -> subprocess.CompletedProcess[str]:
    """The real command line (`python -m chatroute`), as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "chatroute", *args],
        capture_output=True,
        text=True,
        env=_env(env),
        timeout=300,
        check=False,
    )


def _write_case(name: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(CONFIG)
    CASES[name].change(config, folder)
    path = folder / "chatroute.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


# The real command line is slow to start (it imports torch): `serve` runs as a subprocess
# on two of the cases (a config that does not validate, a model that cannot be found), and
# in-process (the same code: the command group turns the error into exit 2) on all of them.
SUBPROCESS_CASES = [
    "base_url without a scheme",
    "embedder path that does not exist",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`chatroute serve` run as a subprocess on some bad configs: name -> (path, result)."""
    root = tmp_path_factory.mktemp("serve")
    paths = {name: _write_case(name, root / f"case{i}") for i, name in enumerate(SUBPROCESS_CASES)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(_cli, "serve", "--config", str(path), env=CASES[name].env)
            for name, path in paths.items()
        }
        return {name: (paths[name], future.result()) for name, future in futures.items()}


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.mark.parametrize("name", list(CASES))
def test_check_catches_the_bad_config_and_serve_fails_with_the_same_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("serve started on a bad config")

    monkeypatch.setattr("chatroute.server.startup.run_server", never)
    case = CASES[name]
    path = _write_case(name, tmp_path / "case")
    expected = f"error: {path}: " + case.expected.format(folder=path.parent)
    for key, value in case.env:
        monkeypatch.setenv(key, value)

    checked = _invoke(["check", "--config", str(path)])
    served = _invoke(["serve", "--config", str(path)])

    assert checked.exit_code == 2, checked.output
    assert "config ok" not in checked.output
    assert any(line.startswith(expected) for line in _errors(checked.output)), checked.output
    assert served.exit_code == 2, served.output
    assert _errors(served.output) == _errors(checked.output)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_the_serve_command_prints_that_line_without_a_traceback(
    name: str, served: dict[str, Any]
) -> None:
    path, serve = served[name]
    expected = f"error: {path}: " + CASES[name].expected.format(folder=path.parent)
    assert serve.returncode == 2, serve.stderr[-3000:]
    assert "Traceback" not in serve.stderr
    (line,) = _errors(serve.stderr)
    assert line.startswith(expected)
    assert serve.stdout == ""


def test_the_same_configs_pass_once_mended(tmp_path: Path) -> None:
    # The base config the cases start from is good: check finds nothing (model found only).
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    result = CliRunner().invoke(
        app, ["check", "--config", str(path), "--no-model"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "config ok" in result.output


def test_check_loads_the_model_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder that looks like a model (it has a config.json) but cannot be loaded: only
    # loading it tells, and `check` does unless --no-model.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    config = copy.deepcopy(CONFIG)
    config["embedder"] = {"model": str(broken), "device": "cpu"}
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    runner = CliRunner()

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("serve started although its model cannot be loaded")

    monkeypatch.setattr("chatroute.server.startup.run_server", never)

    loaded = runner.invoke(app, ["check", "--config", str(path)], catch_exceptions=False)
    skipped = runner.invoke(
        app, ["check", "--config", str(path), "--no-model"], catch_exceptions=False
    )
    served = runner.invoke(app, ["serve", "--config", str(path)], catch_exceptions=False)

    assert loaded.exit_code == 2, loaded.output
    (line,) = _errors(loaded.output)
    assert line.startswith(f"error: {path}: embedder.model: the model could not be loaded: ")
    assert str(broken) in line
    assert skipped.exit_code == 0, skipped.output
    # serve loads the model before it listens, so it fails the same way, not at start-up.
    assert served.exit_code == 2, served.output
    assert _errors(served.output) == [line]


def test_check_builds_the_model_as_serve_does_and_closes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Any] = []

    class Closable:
        closed = False

        async def aclose(self) -> None:
            self.closed = True

    def build(config: Any) -> Closable:
        built.append(Closable())
        return built[-1]

    monkeypatch.setattr("chatroute.engine.build_embedder", build)
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    result = CliRunner().invoke(app, ["check", "--config", str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(built) == 1 and built[0].closed


# Reading a config and finding its model need no torch: a config error, or `check
# --no-model`, answers in well under a second instead of importing torch first.
_NO_TORCH = """
import json, sys
from chatroute.cli import main

codes = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["chatroute", *argv]
    try:
        main()
    except SystemExit as exc:
        codes.append(exc.code)
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules}))
"""


def test_checks_that_load_no_model_do_not_import_torch(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    bad = _write_case("embedder path that does not exist", tmp_path / "bad")
    runs = [
        ["check", "--no-model", "--config", str(good)],
        ["serve", "--config", str(bad)],
        ["route", "--config", str(bad), "hello"],
    ]
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, json.dumps(runs)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"codes": [0, 2, 2], "torch": False}
    assert len(_errors(done.stderr)) == 2  # serve's and route's line about the model path


@pytest.mark.parametrize(
    ("device", "dtype", "problem"),
    [
        ("cpu", "fp32", None),
        ("cpu:0", "bf16", None),
        ("auto", "auto", None),
        ("auto", "bf16", None),
        ("cpu", "fp16", ("embedder.dtype", "dtype fp16 needs a CUDA device")),
        ("auto", "float16", ("embedder.dtype", "dtype fp16 needs a CUDA device")),
        ("cuda", "auto", ("embedder.device", "CUDA is not available")),
        ("cuda:1", "fp16", ("embedder.device", "CUDA is not available")),
        ("tpu", "auto", ("embedder.device", "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")),
    ],
)
def test_device_and_dtype_problems_on_a_machine_without_cuda(
    device: str, dtype: str, problem: tuple[str, str] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from chatroute.checks import config_problems
    from chatroute.config import parse_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = copy.deepcopy(CONFIG)
    data["embedder"] = {"model": "default", "device": device, "dtype": dtype}
    found = config_problems(parse_config(data, environ={}))
    if problem is None:
        assert found == []
    else:
        ((key, message),) = found
        assert key == problem[0] and problem[1] in message, found


# ------------------------------------------------------------- a command's own paths


@pytest.fixture
def good_config(tmp_path: Path) -> Path:
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return path


def test_classify_into_a_folder_and_index_build_onto_a_file_are_one_line_each(
    good_config: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('"hello"\n')
    folder = tmp_path / "out.jsonl"  # an output that exists and is no classify output
    folder.write_text('{"not": "a classify output"}\n')
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not an index\n")
    classified = _invoke(["classify", "-c", str(good_config), str(source), "-o", str(folder)])
    indexed = _invoke(["index", "build", "-c", str(good_config), "-o", str(a_file)])

    for result in (classified, indexed):
        assert result.exit_code == 2, result.output[-3000:]
        assert "Traceback" not in result.output
        assert result.stdout == ""
    assert _errors(classified.stderr) == [
        f"error: {folder} exists and is not a resumable classify output (no fingerprint"
        " record beside it); --overwrite replaces it"
    ]
    assert _errors(indexed.stderr) == [
        f"error: --output {a_file}: is a file, not a profile index folder"
    ]
    assert a_file.read_text() == "not an index\n"
    assert folder.read_text() == '{"not": "a classify output"}\n'


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["fit", "{config}", "{tmp}/missing.jsonl"], "LABELLED {tmp}/missing.jsonl: no such file"),
        (
            ["fit", "{config}", "{tmp}/in.jsonl", "-o", "{tmp}/no/such/dir/t.json"],
            "--output {tmp}/no/such/dir/t.json: the folder {tmp}/no/such/dir does not exist",
        ),
        (
            ["classify", "{config}", "{tmp}/in.jsonl", "-o", "{tmp}/in.jsonl"],
            "--output {tmp}/in.jsonl: is the input file; write the output to another file",
        ),
        (
            ["classify", "{config}", "{tmp}", "-o", "{tmp}/out.jsonl"],
            "SOURCE {tmp}: is a folder; give the path of a file",
        ),
        (
            ["index", "build", "{config}", "-o", "{tmp}"],
            "--output {tmp}: holds other files but no profile index (manifest.json); "
            "give an empty or a new folder",
        ),
    ],
)
def test_bad_paths_on_the_command_line_are_one_line_and_exit_2(
    good_config: Path, tmp_path: Path, args: list[str], expected: str
) -> None:
    (tmp_path / "in.jsonl").write_text('{"input": "hello", "route": "general"}\n')
    argv: list[str] = []
    for arg in args:
        if arg == "{config}":
            argv += ["-c", str(good_config)]
        else:
            argv.append(arg.format(tmp=tmp_path))
    result = CliRunner().invoke(app, argv, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert _errors(result.output) == ["error: " + expected.format(tmp=tmp_path)]


def test_fit_may_write_the_thresholds_file_the_config_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_embedder: Callable[[], Any]
) -> None:
    # The documented first run: the config already names thresholds.json, fit creates it.
    monkeypatch.setattr("chatroute.engine.build_embedder", lambda config: default_embedder())
    config = copy.deepcopy(CONFIG)
    config["routing"]["thresholds_file"] = "thresholds.json"
    path = tmp_path / "chatroute.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    labelled = tmp_path / "labelled.jsonl"
    labelled.write_text(
        "\n".join(
            json.dumps({"input": text, "route": route})
            for text, route in [
                ("my code throws an exception when I run it", "code"),
                ("sort this list in python for me", "code"),
                ("integrate x squared from zero to one", "math"),
                ("solve for y in 2y = 10", "math"),
                ("how do I fix a flat bicycle tyre", None),
                ("solve my scheduling problem at work", None),
                ("write a wedding speech", None),
            ]
        )
    )
    refused = _invoke(["route", "-c", str(path), "hello"])
    fitted = _invoke(
        ["fit", "-c", str(path), str(labelled), "-o", str(tmp_path / "thresholds.json")]
    )
    routed = _invoke(["route", "-c", str(path), "hello"])
    assert refused.exit_code == 2
    assert _errors(refused.output) == [
        f"error: {path}: routing.thresholds_file: cannot read {tmp_path}/thresholds.json: "
        "No such file or directory"
    ]
    assert fitted.exit_code == 0, fitted.output
    assert routed.exit_code == 0, routed.output


# ------------------------------------------------------------------ the handler itself


def _tiny_app(exc: BaseException) -> typer.Typer:
    tiny = typer.Typer(cls=UserErrorGroup)

    @tiny.command()
    def boom() -> None:
        raise exc

    @tiny.command()
    def fine() -> None:
        typer.echo("fine")

    return tiny


@pytest.mark.parametrize(
    ("exc", "lines"),
    [
        (
            ConfigError([("routing.threshold", "too high"), ("routes", "empty")], "c.yaml"),
            ["error: c.yaml: routing.threshold: too high", "error: c.yaml: routes: empty"],
        ),
        (PathError("--output", "x/", "is a folder"), ["error: --output x/: is a folder"]),
        (
            FileNotFoundError(2, "No such file or directory", "data.jsonl"),
            ["error: data.jsonl: No such file or directory"],
        ),
    ],
)
def test_a_users_error_becomes_one_line_per_problem_and_exit_2(
    exc: BaseException, lines: list[str]
) -> None:
    result = CliRunner().invoke(_tiny_app(exc), ["boom"])
    assert result.exit_code == 2
    assert _errors(result.output) == lines
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    "exc", [RuntimeError("a bug"), KeyError("x"), FileNotFoundError("no filename: a bug")]
)
def test_a_bug_still_shows_its_traceback(exc: BaseException) -> None:
    result = CliRunner().invoke(_tiny_app(exc), ["boom"])
    assert result.exception is exc
    assert _errors(result.output) == []


# ------------------------------------------------------------- the checks as functions


def test_path_checks(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert input_file("IN", tmp_path / "f") == tmp_path / "f"
    assert output_file("--output", None) is None
    assert output_file("--output", tmp_path / "new.jsonl") == tmp_path / "new.jsonl"
    with pytest.raises(PathError, match="no such file"):
        input_file("IN", tmp_path / "missing")
    assert index_folder_problem(tmp_path / "new" / "index") is None  # created on save
    (tmp_path / "idx").mkdir()
    assert index_folder_problem(tmp_path / "idx") is None  # empty: fine
    (tmp_path / "idx" / "manifest.json").write_text("{}")
    (tmp_path / "idx" / "vectors.npy").write_text("")
    assert index_folder_problem(tmp_path / "idx") is None  # an index: fine
    assert (
        index_folder_problem(tmp_path / "f" / "index")
        == f"cannot be created: {tmp_path / 'f'} is a file"
    )


def test_a_misspelled_key_gets_the_nearest_known_one_at_every_level() -> None:
    from chatroute.config import parse_config

    data = copy.deepcopy(CONFIG)
    data["rsilience"] = {}
    data["providers"]["p"]["timeouts"] = {"first_tokens": 3, "reqest": 9}
    data["routes"]["code"]["options"] = {"max_token": 5}
    data["routes"]["math"]["zzz"] = 1
    # A key that belongs one block further in: its place there is named.
    data["providers"]["p"]["first_token_timeout"] = 30
    data["routes"]["math"]["stal"] = 5
    data["routing"]["scoring"] = "protoype"  # a misspelled value of a fixed set
    data["providers"]["p"]["type"] = "opneai"  # a misspelled provider type
    with pytest.raises(ConfigError) as caught:
        parse_config(data, environ={})
    assert sorted(caught.value.problems) == [
        (
            "providers.p.first_token_timeout",
            "unknown key (did you mean 'timeouts.first_token'?)",
        ),
        ("providers.p.timeouts.first_tokens", "unknown key (did you mean 'first_token'?)"),
        ("providers.p.timeouts.reqest", "unknown key (did you mean 'request'?)"),
        (
            "providers.p.type",
            "unknown provider type 'opneai' (did you mean 'openai'?); known: openai, anthropic",
        ),
        ("routes.code.options.max_token", "unknown key (did you mean 'max_tokens'?)"),
        ("routes.math.stal", "unknown key (did you mean 'timeouts.stall'?)"),
        ("routes.math.zzz", "unknown key"),
        (
            "routing.scoring",
            "Input should be 'prototype', 'knn', 'top_k' or 'adapter' (did you mean 'prototype'?)",
        ),
        ("rsilience", "unknown key (did you mean 'resilience'?)"),
    ]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:8001/v1", None),
        ("https://api.openai.com/v1", None),
        ("localhost:8001/v1", "has no scheme: write it as http://localhost:8001/v1"),
        ("ftp://host/v1", "has the scheme 'ftp'; expected http:// or https://"),
        ("http://host:99999/v1", "has a bad port"),
        ("http:///v1", "names no host"),
        (" http://host/v1", "is not a URL"),
    ],
)
def test_url_problems(url: str, problem: str | None) -> None:
    from chatroute._config_values import url_problem

    found = url_problem(url)
    assert found is None if problem is None else (found is not None and problem in found)


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("X-Team", "search", None),
        ("X-Team", "a\nb", "line break or NUL"),
        ("X-Team", "a\x00b", "line break or NUL"),
        ("X-Team", "caf\u00e9", "control or non-ASCII"),
        ("X Team", "a", "not a valid HTTP token"),
    ],
)
def test_header_problems(name: str, value: str, problem: str | None) -> None:
    from chatroute._config_values import header_problem

    found = header_problem(name, value)
    assert found is None if problem is None else (found is not None and problem in found)
