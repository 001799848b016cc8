"""`chatroute classify`, local engine: formats, stdin/stdout, resume and refusal, bad rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import yaml
from classify_helpers import CONFIG, read_rows, sentences, write_rows
from typer.testing import CliRunner

from chatroute.cli import app
from tests.semantic_doubles import BagOfWordsEmbedder

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "my python program crashes with an exception",
    "compute the integral of x cubed",
    "hello, how are you today",
    "",
    "write a function that reverses a string",
]
ROUTES = ["code", "math", "general", "general", "code"]


def run(*args: Any, stdin: bytes | None = None) -> Any:
    return runner.invoke(app, [str(a) for a in args], input=stdin, catch_exceptions=False)


def rows_in() -> list[dict[str, Any]]:
    return [{"text": text, "uid": 100 + n, "region": f"r{n}"} for n, text in enumerate(TEXTS)]


@pytest.mark.parametrize("source_format", ["jsonl", "csv", "parquet"])
@pytest.mark.parametrize("output_format", ["jsonl", "csv", "parquet"])
def test_each_format_in_and_out_gives_the_same_rows(
    config_file: Path, tmp_path: Path, source_format: str, output_format: str
) -> None:
    source = tmp_path / f"in.{source_format}"
    write_rows(source, rows_in(), source_format)
    out = tmp_path / f"out.{output_format}"
    summary = tmp_path / "summary.json"
    result = run(
        "classify", "-c", config_file, source, "-o", out, "--text-field", "text",
        "--id-field", "uid", "--keep", "region", "--scores", "--summary", summary,
        "--no-progress",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = read_rows(out, output_format)
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["route"] for r in rows] == ROUTES
    # CSV carries every column as text; Parquet and JSONL keep the input's types.
    ids = [str(r["id"]) for r in rows]
    assert ids == [str(100 + n) for n in range(5)]
    assert [r["region"] for r in rows] == [f"r{n}" for n in range(5)]
    assert all(r["scoring"] == "prototype" for r in rows)  # the service default
    empty = rows[3]
    assert empty["is_default"] in (True, "true") and empty["score"] in (None, "")
    if output_format == "jsonl":
        assert rows[0]["scores"]["code"] == rows[0]["score"]
    else:
        assert rows[0]["score_code"] == rows[0]["score"]
    document = json.loads(summary.read_text())
    assert document["total"] == 5 and document["empty"] == 1 and document["bad"] == 0
    by_route = {r["route"]: r for r in document["routes"]}
    assert by_route["code"]["count"] == 2 and by_route["code"]["share"] == pytest.approx(0.4)
    assert by_route["general"]["default_share"] == pytest.approx(0.5)


def test_stdin_to_stdout(config_file: Path) -> None:
    lines = "".join(json.dumps({"input": t, "id": n}) + "\n" for n, t in enumerate(TEXTS))
    result = run(
        "classify", "-c", config_file, "-", "-o", "-", "--output-format", "csv", "--no-progress",
        stdin=lines.encode(),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    table = pacsv.read_csv(pa.BufferReader(result.stdout_bytes))
    assert table.column("route").to_pylist() == ROUTES
    assert table.column("id").to_pylist() == [0, 1, 2, 3, 4]
    assert "classified 5 inputs" in result.stderr
    assert not Path("-").exists()


def test_parquet_from_stdin_and_jsonl_to_stdout(config_file: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.parquet"
    write_rows(source, [{"input": t} for t in TEXTS], "parquet")
    result = run(
        "classify", "-c", config_file, "-", "--format", "parquet", "-o", "-", "--no-progress",
        stdin=source.read_bytes(),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["route"] for r in records] == ROUTES


def test_a_folder_output_resumes_after_its_last_complete_part(
    config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    texts = sentences(60)
    write_rows(source, [{"input": t} for t in texts], "jsonl")
    out = tmp_path / "parts"
    args = ["classify", "-c", config_file, source, "-o", f"{out}/", "--batch-size", 10,
            "--part-rows", 20, "--no-progress"]  # fmt: skip
    assert run(*args).exit_code == 0
    complete = read_rows(out, "parquet")
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 3 and [r["line"] for r in complete] == list(range(1, 61))
    # An interrupted run: the last part never completed, the record says unfinished.
    parts[-1].rename(out / ".part-00002.parquet.inprogress")
    manifest = out / "_classify.json"
    manifest.write_text(manifest.read_text().replace('"complete": true', '"complete": false'))
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert "resumed after line 40" in result.output and "classified 20 inputs" in result.output
    again = read_rows(out, "parquet")
    assert [(r["line"], r["route"]) for r in again] == [(r["line"], r["route"]) for r in complete]
    assert not list(out.glob(".*inprogress"))
    # The summary counts the whole output, the resumed rows included.
    assert "│ total   │    60 │" in result.output


def test_a_rerun_with_other_settings_is_refused_naming_the_change(
    config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    write_rows(source, [{"input": t} for t in TEXTS], "jsonl")
    out = tmp_path / "out.jsonl"
    assert run("classify", "-c", config_file, source, "-o", out, "--no-progress").exit_code == 0
    written = out.read_text()
    changed = json.loads(json.dumps(CONFIG))
    changed["routing"]["threshold"] = 0.3
    changed["routes"]["math"]["utterances"].append("factor this polynomial")
    config_file.write_text(yaml.safe_dump(changed), encoding="utf-8")
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress")
    assert result.exit_code == 2
    assert "threshold: 0.25 -> 0.3" in result.output
    assert "route 'math': utterances changed" in result.output
    assert "--overwrite" in result.output and "Traceback" not in result.output
    assert out.read_text() == written
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress", "--scores")
    assert result.exit_code == 2 and "scores: False -> True" in result.output
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress", "--overwrite")
    assert result.exit_code == 0, result.output
    assert len(out.read_text().splitlines()) == 5


def test_an_existing_file_that_is_not_a_classify_output_is_refused(
    config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    write_rows(source, [{"input": t} for t in TEXTS], "jsonl")
    out = tmp_path / "precious.csv"
    out.write_text("a,b\n1,2\n")
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress")
    assert result.exit_code == 2
    assert "exists and is not a resumable classify output" in result.output
    assert out.read_text() == "a,b\n1,2\n"


def test_bad_rows_are_each_reported_and_fail_the_run(config_file: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    lines = [
        json.dumps({"input": "solve this equation for y"}).encode(),
        b"{broken",
        b'{"input": "caf\xe9 au lait"}',  # Latin-1, not UTF-8
        json.dumps({"input": ""}).encode(),
        json.dumps({"text": "no input field"}).encode(),
        json.dumps({"input": "fix the bug in my code"}).encode(),
    ]
    source.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress")
    assert result.exit_code == 1  # everything read, but malformed rows fail the run
    assert f"{source}:2: skipped: not valid JSON" in result.output
    assert f"{source}:3: skipped: not valid UTF-8" in result.output
    assert f"{source}:5: skipped: no 'input' or 'messages' field (fields: text)" in result.output
    assert "1 empty; 3 bad rows" in result.output
    assert [r["line"] for r in read_rows(out, "jsonl")] == [1, 4, 6]
    tolerated = run("classify", "-c", config_file, source, "-o", "-", "--max-bad", 3)
    assert tolerated.exit_code == 0
    stopped = run(
        "classify", "-c", config_file, source, "-o", "-", "--max-bad", 1, "--batch-size", 1
    )
    assert stopped.exit_code == 1
    assert "more than 1 bad rows (2, the last at" in stopped.output
    assert f"{source}:5" not in stopped.output  # stopped before reading on


def test_csv_rows_that_are_not_utf8_are_bad_rows(config_file: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.csv"
    source.write_bytes(b'input,id\nhello there,1\ncaf\xe9,2\n"solve x + 1 = 2",3\n')
    result = run("classify", "-c", config_file, source, "-o", "-", "--no-progress")
    assert result.exit_code == 1
    assert f"{source}: row 2: skipped: not valid UTF-8" in result.stderr
    assert [json.loads(x)["id"] for x in result.stdout.splitlines()] == ["1", "3"]


def test_a_missing_column_names_it_and_the_columns_found(config_file: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.parquet"
    write_rows(source, rows_in(), "parquet")
    result = run("classify", "-c", config_file, source, "-o", "-", "--text-field", "body")
    assert result.exit_code == 2
    assert "has no column 'body' (columns found: text, uid, region)" in result.output
    result = run("classify", "-c", config_file, source, "-o", "-")
    assert result.exit_code == 2
    assert "no 'input' or 'messages' column (columns found: text, uid, region)" in result.output
    result = run("classify", "-c", config_file, source, "-o", "-", "--text-field", "uid")
    assert result.exit_code == 2
    assert "column 'uid' is int64, not text" in result.output
    assert "Traceback" not in result.output


def test_messages_rows_are_routed_on_their_last_user_turn(
    config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.parquet"
    conversation = [
        {"role": "user", "content": "solve this equation for x"},
        {"role": "assistant", "content": "x = 2"},
        {"role": "user", "content": "now fix the bug in my python code"},
    ]
    pq.write_table(pa.Table.from_pylist([{"messages": conversation}]), source)
    result = run("classify", "-c", config_file, source, "-o", "-", "--no-progress")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0])["route"] == "code"


def test_ctrl_c_says_how_to_resume_and_the_rerun_completes(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real command line in a subprocess, interrupted by a real SIGINT as soon as its
    # first batch is written; the resumed run (in this process) does the rest. Decisions
    # come from a hashed bag-of-words double (the test is about interrupting and resuming,
    # not the model): neither process loads a model. Batches of one row, each taking
    # 20 ms, keep the subprocess's whole run several seconds long, so that a loaded
    # machine delaying the signal cannot let it finish first.
    rows = 480
    source = tmp_path / "in.jsonl"
    texts = sentences(rows)
    write_rows(source, [{"input": t} for t in texts], "jsonl")
    out = tmp_path / "out.jsonl"
    code = (
        "import sys; import chatroute.engine; from tests.semantic_doubles import "
        "BagOfWordsEmbedder; chatroute.engine.build_embedder = lambda config: "
        "BagOfWordsEmbedder(delay=0.02); from chatroute.cli import main; "
        "sys.argv[0] = 'chatroute'; main()"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", code, "classify", "-c", str(config_file), str(source), "-o",
         str(out), "--batch-size", "1", "--no-progress"],
        stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    while not out.exists() or out.stat().st_size == 0:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err.decode()
    assert b"rerun the same command to resume" in err
    written = read_rows(out, "jsonl")
    assert 0 < len(written) < rows
    monkeypatch.setattr("chatroute.engine.build_embedder", lambda config: BagOfWordsEmbedder())
    result = run("classify", "-c", config_file, source, "-o", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert f"resumed after line {written[-1]['line']}" in result.output
    assert [r["line"] for r in read_rows(out, "jsonl")] == list(range(1, rows + 1))
