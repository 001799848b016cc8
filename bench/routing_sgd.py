"""Multi-turn routing on sgd_routing dev: accuracy by turn kind per context policy, and cost.

Run: `python bench/routing_sgd.py` (data: $CHATROUTE_SGD_ROUTING or ../shared/data/sgd_routing).
Accuracy is measured for each `--runs` entry (scoring mode @ threshold) and both policies,
each distinct text embedded once for all of them; the cost with the real embedder, uncached.
Writes its tables to BENCHMARKS.md between the `routing-sgd` markers and prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from _common import REPO, command, machine, table, write_section

from chatroute import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatRole,
    ConversationPolicy,
    EmbeddingGenerator,
    LastUserPolicy,
    ScoreAggregation,
    SemanticRoutingChatClient,
    SentenceTransformerEmbedder,
)
from chatroute.router.conversation import DEFAULT_TEMPERATURES

KINDS = ("open", "follow", "switch")
# What the accuracy table measures by default: each scoring mode at the service's default
# threshold, and the learned mode at 0.2 (see docs/conversations.md for where 0.2 comes from).
RUNS = "top_k@0.3,prototype@0.3,prototype@0.2"


class RouteClient(ChatClient):
    """A stand-in route target: the benchmark only asks for decisions."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        raise NotImplementedError

    def get_streaming_response(self, messages: Any, options: Any = None) -> Any:
        raise NotImplementedError


def data_path() -> Path:
    env = os.environ.get("CHATROUTE_SGD_ROUTING")
    return Path(env) if env else REPO.parent / "shared" / "data" / "sgd_routing"


def load() -> tuple[dict[str, list[str]], list[dict[str, Any]]]:
    root = data_path()
    profiles = json.loads((root / "profiles.json").read_text(encoding="utf-8"))
    with open(root / "dev.jsonl", encoding="utf-8") as fh:
        dialogues = [json.loads(line) for line in fh if line.strip()]
    return profiles, dialogues


def prefixes(dialogue: dict[str, Any]) -> list[list[ChatMessage]]:
    """The messages a request carries at each user turn of a dialogue."""
    out: list[list[ChatMessage]] = []
    messages: list[ChatMessage] = []
    for turn in dialogue["turns"]:
        if turn["system_before"]:
            messages.append(ChatMessage(ChatRole.ASSISTANT, turn["system_before"]))
        messages.append(ChatMessage(ChatRole.USER, turn["user"]))
        out.append(list(messages))
    return out


class CachedGenerator(EmbeddingGenerator):
    """Embeds each distinct text once (accuracy runs share it; the cost runs do not)."""

    def __init__(self, inner: EmbeddingGenerator) -> None:
        self.inner = inner
        self.cache: dict[str, np.ndarray] = {}

    async def generate(self, values: Sequence[str]) -> np.ndarray:
        missing = list(dict.fromkeys(v for v in values if v not in self.cache))
        for start in range(0, len(missing), 4096):
            chunk = missing[start : start + 4096]
            vectors = np.asarray(await self.inner.generate(chunk), dtype=np.float32)
            self.cache.update(zip(chunk, vectors, strict=True))
        return np.stack([self.cache[v] for v in values]).astype(np.float32)


class Setup:
    def __init__(self, args: argparse.Namespace, embedder: EmbeddingGenerator) -> None:
        self.profiles, self.dialogues = load()
        self.clients = {name: RouteClient(name) for name in self.profiles}
        self.default = RouteClient("default")
        self.args = args
        self.embedder = embedder
        self.cached = CachedGenerator(embedder)

    def router(
        self,
        context: Any,
        *,
        scoring: str,
        threshold: float,
        generator: EmbeddingGenerator | None = None,
    ) -> SemanticRoutingChatClient:
        return SemanticRoutingChatClient(
            generator or self.embedder,
            {self.clients[name]: texts for name, texts in self.profiles.items()},
            self.default,
            score_threshold=threshold,
            top_k=self.args.top_k,
            score_aggregation=ScoreAggregation.MEAN,
            leave_open=True,
            context=context,
            scoring=scoring,
        )


async def accuracy(
    setup: Setup, context: Any, scoring: str, threshold: float
) -> dict[str, tuple[int, int]]:
    router = setup.router(context, scoring=scoring, threshold=threshold, generator=setup.cached)
    tally = {kind: [0, 0] for kind in KINDS}
    batch: list[list[ChatMessage]] = []
    labels: list[tuple[str, str]] = []

    async def flush() -> None:
        decisions = await router.route_conversations(batch)
        for decision, (kind, label) in zip(decisions, labels, strict=True):
            tally[kind][1] += 1
            tally[kind][0] += decision.client is setup.clients[label]
        batch.clear()
        labels.clear()

    for dialogue in setup.dialogues:
        for turn, messages in zip(dialogue["turns"], prefixes(dialogue), strict=True):
            if turn["kind"] in KINDS:
                batch.append(messages)
                labels.append((turn["kind"], turn["label"]))
        if len(batch) >= 512:
            await flush()
    if batch:
        await flush()
    return {kind: (right, total) for kind, (right, total) in tally.items()}


async def cost_batch1(setup: Setup, dialogues: int) -> dict[str, float]:
    """Median ms per request, turn after turn of the same dialogues, in a random order."""
    mode = {"scoring": setup.args.cost_scoring, "threshold": 0.3}
    single = setup.router(LastUserPolicy(), **mode)
    conversation = setup.router(ConversationPolicy(), **mode)
    cold = setup.router(ConversationPolicy(cache_size=0), **mode)
    await single.route([ChatMessage(ChatRole.USER, "warm up")])
    times: dict[str, list[float]] = {"single": [], "conversation": [], "uncached": []}
    rng = random.Random(7)
    ratios: list[float] = []
    for dialogue in rng.sample(setup.dialogues, dialogues):
        for messages in prefixes(dialogue):
            order = [("single", single), ("conversation", conversation), ("uncached", cold)]
            rng.shuffle(order)  # no policy always runs first, or right after another
            took: dict[str, float] = {}
            for name, router in order:
                start = time.perf_counter()
                await router.route(messages)
                took[name] = time.perf_counter() - start
                times[name].append(took[name])
            ratios.append(took["conversation"] / took["single"])
    result = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    result["paired"] = statistics.median(ratios)
    return result


async def cost_batch(setup: Setup, size: int, groups: int) -> dict[str, float]:
    """Ms per decision in batches of `size`: each conversation's newest turn is new, its
    earlier turns were decided by the previous batch (as in a live service)."""
    mode = {"scoring": setup.args.cost_scoring, "threshold": 0.3}
    single = setup.router(LastUserPolicy(), **mode)
    conversation = setup.router(ConversationPolicy(), **mode)
    rng = random.Random(11)
    long_enough = [d for d in setup.dialogues if len(d["turns"]) >= 4]
    times: dict[str, list[float]] = {"single": [], "conversation": []}
    for _ in range(groups):
        chosen = [prefixes(d) for d in rng.sample(long_enough, size)]
        for step in range(1, 4):
            await conversation.route_conversations([p[step - 1] for p in chosen])  # earlier turns
            batch = [p[step] for p in chosen]
            queries = [p[step][-1].text for p in chosen]
            start = time.perf_counter()
            await single.route_batch(queries)
            times["single"].append((time.perf_counter() - start) / size)
            start = time.perf_counter()
            await conversation.route_conversations(batch)
            times["conversation"].append((time.perf_counter() - start) / size)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def pct(right: int, total: int) -> str:
    return f"{100.0 * right / total:.1f}% ({right}/{total})" if total else "-"


def parse_runs(text: str) -> list[tuple[str, float]]:
    """`scoring@threshold,...` as (scoring, threshold) pairs."""
    runs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        scoring, _, threshold = item.partition("@")
        runs.append((scoring, float(threshold) if threshold else 0.3))
    return runs


async def run(args: argparse.Namespace) -> str:
    embedder = SentenceTransformerEmbedder(device=args.device)
    setup = Setup(args, embedder)
    rows = []
    loads = [os.getloadavg()[0]]
    for scoring, threshold in parse_runs(args.runs) if not args.skip_accuracy else []:
        for name, context in [
            ("last_user", LastUserPolicy()),
            ("conversation", ConversationPolicy()),
        ]:
            started = time.perf_counter()
            result = await accuracy(setup, context, scoring, threshold)
            right = sum(r for r, _ in result.values())
            total = sum(t for _, t in result.values())
            rows.append(
                [name, scoring, threshold, pct(right, total), *(pct(*result[k]) for k in KINDS)]
            )
            print(rows[-1], f"{time.perf_counter() - started:.0f} s", flush=True)
    loads.append(os.getloadavg()[0])
    one = await cost_batch1(setup, args.cost_dialogues)
    print("batch 1", one, flush=True)
    many = await cost_batch(setup, 256, args.cost_groups)
    print("batch 256", many, flush=True)
    loads.append(os.getloadavg()[0])
    await embedder.aclose()
    policy = ConversationPolicy()
    lines = [
        "## Conversation-aware routing on sgd_routing dev (bench/routing_sgd.py)",
        "",
        f"Machine: {machine()}; load average (1 min) at the start / after the accuracy runs / "
        f"at the end: {' / '.join(f'{value:.1f}' for value in loads)}.",
        f"Command: `{command()}`.",
        f"Router: default model, per-route profiles of 20 opening utterances, top_k {args.top_k} "
        f"mean; `conversation` = `{policy!r}` (temperature per scoring mode: "
        + ", ".join(f"{mode} {value}" for mode, value in DEFAULT_TEMPERATURES.items())
        + "). A turn counts as right when the routed client (the default client when below "
        "threshold) is its label; each turn is decided from the messages a request carries "
        "at that point. Threshold 0.3 is the service's default; 0.2 for `prototype` is that "
        "default moved by the gap between the two modes' best thresholds on CLINC150's "
        "validation split (bench/clinc_threshold_gap.py, docs/conversations.md), not fitted "
        "on this set.",
        "",
        table(
            ["policy", "scoring", "threshold", "labelled turns", *KINDS],
            rows,
        )
        if rows
        else "",
        "",
        "Cost per decision (median ms, the real embedder, scoring "
        f"`{args.cost_scoring}`; `conversation`: earlier turns decided by the "
        "conversation's earlier requests, as in a service; `uncached`: no turn cache, the "
        f"whole window embedded per request). Batch 1: {args.cost_dialogues} dialogues turn "
        "by turn, the three in a random order per turn (paired: the median of per-turn "
        f"ratios); batch 256: {args.cost_groups} groups x 3 turns.",
        "",
        table(
            ["batch", "single message (last_user)", "conversation", "ratio (paired)", "uncached"],
            [
                [
                    1,
                    f"{one['single']:.2f}",
                    f"{one['conversation']:.2f}",
                    f"{one['conversation'] / one['single']:.2f}x ({one['paired']:.2f}x)",
                    f"{one['uncached']:.2f} ({one['uncached'] / one['single']:.2f}x)",
                ],
                [
                    256,
                    f"{many['single']:.3f}",
                    f"{many['conversation']:.3f}",
                    f"{many['conversation'] / many['single']:.2f}x",
                    "-",
                ],
            ],
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--top-k", type=int, default=5, help="the service's default top_k")
    parser.add_argument(
        "--runs", default=RUNS, help=f"accuracy runs, scoring@threshold,... (default {RUNS})"
    )
    parser.add_argument(
        "--cost-scoring", default="prototype", help="the scoring mode of the cost runs"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--cost-dialogues", type=int, default=40)
    parser.add_argument("--cost-groups", type=int, default=2)
    parser.add_argument("--skip-accuracy", action="store_true", help="measure the cost only")
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    text = asyncio.run(run(args))
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "routing-sgd", text)


if __name__ == "__main__":
    main()
