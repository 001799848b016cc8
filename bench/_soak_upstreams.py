"""The soak's faulting upstreams: which fault each request gets, one child process per upstream."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench._soak_service import FIRST_TOKEN_TIMEOUT
from tests.fakes import (
    Behaviour,
    Cut,
    ErrorEvent,
    FakeUpstream,
    Hang,
    Malformed,
    Ok,
    RateLimited,
    Request,
    Reset,
    ServerError,
    SlowFirstToken,
    Stall,
    Truncated,
)

AFTER_OUTPUT = ("cut", "stall", "malformed_late", "truncated")
FAULTS = (
    "reset",
    "server_error",
    "rate_limited",
    "hang",
    "slow_first_token",
    "error_event",
    "malformed_first",
    *AFTER_OUTPUT,
)


@dataclass
class Seen:
    """What one upstream did with one request (times on the shared monotonic clock)."""

    upstream: str
    kind: str
    arrived_at: float
    finished_at: float | None = None


def answer_text(rid: str, words: int) -> str:
    """The answer the upstreams give to the request with id `rid`."""
    return " ".join([f"reply-{rid}", *(f"w{i}" for i in range(words - 1))])


class Injector:
    """The fakes' handler: the right answer for a request's id, or (at `rate`) a fault."""

    def __init__(
        self, rate: float, seed: int, words: int, first_token_delay: float, chunk_delay: float
    ) -> None:
        self.rate = rate
        self.random = random.Random(seed)
        self.words = words
        self.first_token_delay = first_token_delay
        self.chunk_delay = chunk_delay
        self.seen: dict[str, list[tuple[Seen, Request]]] = defaultdict(list)

    def text(self, rid: str) -> str:
        return answer_text(rid, self.words)

    def records(self) -> dict[str, list[Seen]]:
        """What the upstreams did, by request id."""
        out: dict[str, list[Seen]] = {}
        for rid, items in self.seen.items():
            for seen, request in items:
                seen.finished_at = request.finished_at
            out[rid] = [seen for seen, _ in items]
        return out

    def behaviour(self, kind: str, text: str) -> Behaviour:
        first, gap = self.first_token_delay, self.chunk_delay
        makers: dict[str, Callable[[], Behaviour]] = {
            "ok": lambda: Ok(text, first_token_delay=first, chunk_delay=gap),
            "reset": lambda: Reset(),
            "server_error": lambda: ServerError(),
            "rate_limited": lambda: RateLimited(retry_after=None),
            "hang": lambda: Hang(),
            "slow_first_token": lambda: SlowFirstToken(FIRST_TOKEN_TIMEOUT + 0.5, text),
            "error_event": lambda: ErrorEvent(0, text=text),
            "malformed_first": lambda: Malformed(0, text=text),
            "cut": lambda: Cut(3, text=text, chunk_delay=gap),
            "stall": lambda: Stall(3, text=text, chunk_delay=gap),
            "malformed_late": lambda: Malformed(3, text=text),
            "truncated": lambda: Truncated(3, text=text),
        }
        return makers[kind]()

    def handler(self, upstream: str) -> Callable[[Request], Behaviour]:
        def choose(request: Request) -> Behaviour:
            rid = str(request.messages[-1]["content"]) if request.messages else "?"
            kind = "ok"
            if rid.startswith("soak-") and self.random.random() < self.rate:
                kind = self.random.choice(FAULTS)
            self.seen[rid].append((Seen(upstream, kind, request.arrived_at), request))
            return self.behaviour(kind, self.text(rid))

        return choose


FAULTY = ("p1", "p2", "p3")
# The soak script, whose hidden `--fake-child` option runs `run_fake_child` with the soak's
# own options (fault rate, seed, pacing), parsed the same way as in the parent.
SOAK_SCRIPT = Path(__file__).resolve().with_name("load_soak.py")


def run_fake_child(args: argparse.Namespace) -> None:
    """Child mode: serve one faulting upstream in this process (each upstream gets a
    process, so that no two event loops share an interpreter lock); print its base URL,
    then on a `dump PATH` line from stdin write what it did and exit."""
    name = args.fake_child
    seed = args.seed * 1000 + FAULTY.index(name)
    injector = Injector(
        args.fault_rate, seed, args.chunks, args.first_token_delay, args.chunk_delay
    )
    with FakeUpstream() as up:
        up.handler = injector.handler(name)
        print(up.base_url, flush=True)
        for line in sys.stdin:
            if line.startswith("dump "):
                records = {
                    rid: [[s.upstream, s.kind, s.arrived_at, s.finished_at] for s in seen]
                    for rid, seen in injector.records().items()
                }
                Path(line[5:].strip()).write_text(json.dumps(records), encoding="utf-8")
                return


class FakesChild:
    """The faulting upstreams, one child process each (see `run_fake_child`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.urls: dict[str, str] = {}
        for name in FAULTY:
            command_line = [
                sys.executable,
                str(SOAK_SCRIPT),
                f"--fake-child={name}",
                f"--fault-rate={args.fault_rate}",
                f"--seed={args.seed}",
                f"--chunks={args.chunks}",
                f"--chunk-delay={args.chunk_delay}",
                f"--first-token-delay={args.first_token_delay}",
            ]
            process = subprocess.Popen(
                command_line, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            self.processes[name] = process
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            if not line:
                raise RuntimeError(f"the fake upstream {name} did not start")
            self.urls[name] = line

    def records(self) -> dict[str, list[Seen]]:
        """Stop the upstreams and return what they did, by request id."""
        out: dict[str, list[Seen]] = defaultdict(list)
        with tempfile.TemporaryDirectory() as folder:
            for name, process in self.processes.items():
                assert process.stdin is not None
                path = Path(folder) / f"{name}.json"
                process.stdin.write(f"dump {path}\n")
                process.stdin.flush()
                process.wait(60)
                for rid, items in json.loads(path.read_text(encoding="utf-8")).items():
                    out[rid].extend(Seen(*item) for item in items)
        for seen in out.values():
            seen.sort(key=lambda item: item.arrived_at)
        return dict(out)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)
