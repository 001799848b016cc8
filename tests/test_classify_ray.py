"""`chatroute classify --engine ray` on a real local Ray instance (2 CPUs, loopback only)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from classify_helpers import CONFIG, read_rows, write_rows
from typer.testing import CliRunner

from chatroute.chat import EmbeddingGenerator
from chatroute.cli import app
from chatroute.cli.classify_command import ClassifyOptions
from chatroute.cli.classify_ray import LOCAL_CPUS, _cpus_per_actor, start_local_ray

runner = CliRunner()
# The row-for-row run reads blocks of 128 rows (the source's floor, lowered from 1,024 for
# the test) and decides batches of 32: 300 rows make 3 blocks and 10 batches, the last of
# each short. Short texts, so that the model's time stays small.
ROWS = 300
BLOCK_ROWS = 128
_TOPICS = ["python bug", "sort a list", "integral", "derivative", "hello friend", "weather"]


def short_texts(count: int, seed: int = 11) -> list[str]:
    """`count` short texts across the config's routes, reproducible from `seed`."""
    rng = random.Random(seed)
    return [f"{rng.choice(_TOPICS)} {rng.randint(0, 999)}" for _ in range(count)]


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                parent = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


@pytest.fixture(scope="module")
def local_ray() -> Iterator[set[str]]:
    """One local Ray instance for the module; yields the addresses its processes listen on."""
    import ray  # imported here: only the process that runs this module needs it

    start_local_ray(cpus=2)
    try:
        pids = _descendants(os.getpid()) | {os.getpid()}
        listing = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True)
        addresses = set()
        for line in listing.stdout.splitlines():
            owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
            if owners & pids:
                addresses.add(line.split()[3].rsplit(":", 1)[0])
        yield addresses
    finally:
        ray.shutdown()


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "chatroute.yaml"
    path.write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    return path


def run(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_the_local_instance_listens_on_loopback_only(local_ray: set[str]) -> None:
    import ray

    assert local_ray  # the GCS, the raylet and the workers were found
    assert local_ray <= {"127.0.0.1", "[::ffff:127.0.0.1]"}, local_ray
    assert ray.cluster_resources()["CPU"] == 2


@pytest.mark.timeout(600)  # actors start and load the model: slow on a busy machine
def test_ray_decisions_equal_the_local_engine_row_for_row(
    local_ray: set[str],
    config_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    default_embedder: Callable[[], EmbeddingGenerator],
) -> None:
    monkeypatch.setattr("chatroute.cli.classify_ray.MIN_BLOCK_ROWS", BLOCK_ROWS)
    source = tmp_path / "in.jsonl"
    rows = [{"input": t, "id": f"q{n}"} for n, t in enumerate(short_texts(ROWS))]
    rows[10]["input"] = ""
    write_rows(source, rows, "jsonl")
    with open(source, "ab") as fh:
        fh.write(b"{not json\n" + json.dumps({"input": 5}).encode() + b"\n")
    summaries = {name: tmp_path / f"{name}.json" for name in ("ray", "local")}
    result = run(
        "classify", "-c", config_file, source, "-o", tmp_path / "ray", "--engine", "ray",
        "--num-actors", 1, "--batch-size", 32, "--scores", "--summary", summaries["ray"],
        "--max-bad", 2, "--no-progress",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"{source}: row {ROWS + 1}: skipped: not valid JSON" in result.output
    assert f"{source}: row {ROWS + 2}: skipped: 'input' must be a string" in result.output
    # The same rows through the local engine, in this process.
    monkeypatch.setattr("chatroute.engine.build_embedder", lambda config: default_embedder())
    local = run(
        "classify", "-c", config_file, source, "-o", tmp_path / "local.parquet", "--scores",
        "--summary", summaries["local"], "--max-bad", 2, "--no-progress",
    )  # fmt: skip
    assert local.exit_code == 0, local.output
    by_ray = read_rows(tmp_path / "ray", "parquet")
    by_local = read_rows(tmp_path / "local.parquet", "parquet")
    assert len(by_ray) == len(by_local) == ROWS
    for ours, theirs in zip(by_ray, by_local, strict=True):
        assert (ours["line"], ours["id"], ours["route"], ours["is_default"]) == (
            theirs["line"], theirs["id"], theirs["route"], theirs["is_default"]
        )  # fmt: skip
        if theirs["score"] is None:
            assert ours["score"] is None
        else:
            assert ours["score"] == pytest.approx(theirs["score"], abs=1e-5)
    assert by_ray[10]["is_default"] and by_ray[10]["score"] is None
    ray_summary = json.loads(summaries["ray"].read_text())
    local_summary = json.loads(summaries["local"].read_text())
    for key in ("total", "empty", "bad"):
        assert ray_summary[key] == local_summary[key]
    assert [(r["route"], r["count"]) for r in ray_summary["routes"]] == [
        (r["route"], r["count"]) for r in local_summary["routes"]
    ]
    assert ray_summary["engine"] == "ray" and ray_summary["bad"] == 2


def test_local_actors_split_the_local_instances_cpus() -> None:
    # The row-for-row run above uses one actor (each actor loads the model: most of the
    # module's time); that several actors fit a local instance's CPUs is checked here.
    def share(**options: Any) -> float:
        return _cpus_per_actor(ClassifyOptions("in.jsonl", "out", engine="ray", **options))

    assert share(num_actors=1) == LOCAL_CPUS
    assert share(num_actors=2) * 2 == LOCAL_CPUS
    assert share(num_actors=8) == 0.5
    assert share(num_actors=2, ray_address="10.0.0.1:6379") == 1.0  # one CPU on a cluster
    assert share(num_actors=2, cpus_per_actor=0.25) == 0.25


def test_too_many_bad_rows_stop_the_ray_run(
    local_ray: set[str], config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('"hello"\n{bad\n{worse\n"solve for x"\n', encoding="utf-8")
    result = run(
        "classify", "-c", config_file, source, "-o", tmp_path / "out", "--engine", "ray",
        "--max-bad", 1, "--no-progress",
    )  # fmt: skip
    assert result.exit_code == 1
    assert "more than 1 bad rows" in result.output
    assert "Traceback" not in result.output


def test_an_unreachable_ray_address_is_one_line_and_exit_2(
    config_file: Path, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('"hello"\n', encoding="utf-8")
    result = run(
        "classify", "-c", config_file, source, "-o", tmp_path / "out", "--engine", "ray",
        "--ray-address", "127.0.0.1:9", "--no-progress",
    )  # fmt: skip
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: cannot reach the Ray cluster at 127.0.0.1:9: Connection refused"]
