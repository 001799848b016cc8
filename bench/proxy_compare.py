"""Proxy overhead of this tree against another git revision, both measured in one run.

Run from the repository root:

    .venv/bin/python bench/proxy_compare.py --against REV [--pairs 800] [--no-write]

The machine's speed drifts by tens of percent between runs, so a figure from one run
cannot be compared with a figure from another. This checks REV out into a temporary git
worktree and starts two services on the same fixed-latency upstream, one from REV and one
from this tree (same config, same Python environment). Requests then rotate over direct /
REV / this tree at concurrency 1, in a fresh random order each rotation, exactly as
section a. of bench/service_bench.py times them (full answer, or the first content
token), so the two services see the same machine. (A fixed rotation is biased: a service
called right after the other finds the code they share, the Python runtime and the
extension modules, warm in the caches, and in a fixed rotation one of them comes second
more often. With the same code on both sides it showed about 0.1 ms for the one that did.)
It reports each service's added p50 over direct and its CPU per request. The result goes to
the `proxy-compare` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import service_bench as sb
from bench._common import REPO, bench_main, command, machine, table

TRAIN = {"train": [("fix this bug", "code"), ("write a function", "code"), ("weather", "w")]}


def tree_argv(tree: Path, config: Path) -> list[str]:
    """`chatroute serve` with the package imported from `tree`."""
    code = (
        f"import sys; sys.path.insert(0, {str(tree)!r}); import chatroute; "
        f"assert chatroute.__file__.startswith({str(tree)!r}), chatroute.__file__; "
        "from chatroute.cli import main; sys.argv[0] = 'chatroute'; main()"
    )
    return [sys.executable, "-c", code, "serve", "--config", str(config)]


def start_tree(
    stack: ExitStack, tree: Path, upstream: int, work: Path, name: str
) -> tuple[int, str]:
    """Start `chatroute serve` from `tree` on the fixed upstream: its pid and chat URL."""
    port = sb._free_port()
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump(sb.make_config(TRAIN, upstream, port, 10)))
    (work / name).mkdir()
    original = sb.chatroute_argv
    sb.chatroute_argv = lambda path: tree_argv(tree, path)
    try:
        pid = sb.start_service(stack, config, port, work / name)
    finally:
        sb.chatroute_argv = original
    return pid, f"http://127.0.0.1:{port}/v1/chat/completions"


def compare(
    arms: dict[str, tuple[int | None, str]],
    pairs: int,
    stream: bool,
    headers: Mapping[str, Mapping[str, str]] | None = None,
    samples: dict[str, list[float]] | None = None,
) -> list[list[str]]:
    """Each arm's added p50 over the `direct` arm and its process's CPU per request (ms),
    with the arms called in a fresh random order each rotation; `headers` adds headers to
    an arm's requests (its keys, say). `samples`, when given, receives each arm's times
    (seconds), one per rotation in rotation order."""
    body = json.dumps(
        {
            "model": "general",
            "messages": [{"role": "user", "content": sb.QUESTION}],
            "stream": stream,
        }
    ).encode()
    extra = headers or {}
    clients = {name: httpx.Client(timeout=30, headers=extra.get(name)) for name in arms}
    names = list(arms)
    for _ in range(30):
        for name in names:
            sb._timed_call(clients[name], arms[name][1], body, stream)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu = {name: sb.process_cpu(pid) for name, (pid, _) in arms.items() if pid is not None}
    # A fresh order every rotation: a fixed one is biased (see the module docstring).
    order = random.Random(len(names) * pairs + stream)
    for _ in range(pairs):
        order.shuffle(names)
        for name in names:
            times[name].append(sb._timed_call(clients[name], arms[name][1], body, stream))
    for client in clients.values():
        client.close()
    if samples is not None:
        samples.update(times)
    direct = statistics.median(times["direct"])
    rows = []
    for name, (pid, _) in arms.items():
        if pid is None:
            continue
        used = (sb.process_cpu(pid) - cpu[name]) / pairs
        added = statistics.median(times[name]) - direct
        rows.append([name, f"{added * 1e3:.2f}", f"{used * 1e3:.2f}"])
    return rows


def git(*args: str) -> str:
    """The output of a git command in the repository, stripped."""
    done = subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def run(args: argparse.Namespace) -> str:
    revision = git("rev-parse", "--short", args.against)
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "chatroute")
    subject = git("log", "-1", "--format=%s", revision)
    this = f"this tree ({head}{' + uncommitted changes' if dirty else ''})"
    load_before = sb.loadavg()
    with tempfile.TemporaryDirectory(prefix="chatroute-compare-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        other = work / "other"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(other), revision],
            cwd=REPO,
            check=True,
        )
        stack.callback(
            subprocess.run,
            ["git", "worktree", "remove", "--force", str(other)],
            cwd=REPO,
            check=False,
        )
        upstream = sb.start_upstream(stack, args, work)
        arms: dict[str, tuple[int | None, str]] = {
            "direct": (None, f"http://127.0.0.1:{upstream}/v1/chat/completions")
        }
        for name, tree in ((f"revision {revision}", other), (this, REPO)):
            arms[name] = start_tree(stack, tree, upstream, work, name.split()[0])
        rows = []
        for stream in (False, True):
            for name, added, used in compare(arms, args.pairs, stream):
                rows.append([name, "first token" if stream else "full answer", added, used])
                print(" | ".join(rows[-1]), flush=True)
    lines = [
        "## Proxy overhead against another revision, one run",
        "",
        f"- Machine: {machine()}; load average {load_before} before, {sb.loadavg()} after.",
        f"- Command: `{command()}`",
        f"- Both services on one fixed {args.delay_ms:g} ms upstream, forced route, "
        f"concurrency 1; {args.pairs} rotations of direct / revision / this tree per mode, "
        f"each in a fresh random order.",
        f"- Revision {revision}: {subject}",
        "",
        table(["service", "timed to", "added p50 ms", "service CPU ms/req"], rows),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--pairs", type=int, default=800)
    bench_main(parser, run, "proxy-compare")


if __name__ == "__main__":
    main()
