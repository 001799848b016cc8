"""CLINC150 scoring-mode comparison: accuracy, batch-1 A/B, batch-1,024 cost, scaling, report."""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from typing import Any

import numpy as np
from _clinc150 import CachedGenerator, RouteClient, calibrated
from _common import table

from chatroute import (
    ProfileIndex,
    SemanticRoutingChatClient,
    SentenceTransformerEmbedder,
    evaluate_decisions,
    make_scoring,
)

MODES = ("top_k", "knn", "prototype", "adapter")


async def per_decision_us(
    router: SemanticRoutingChatClient, vectors: np.ndarray, batch: int
) -> tuple[float, float]:
    """Best-of-3 microseconds per decision of `route_embeddings` (no encoder) at `batch`:
    wall time, and this process's CPU time (what the decision costs on a shared machine)."""
    best, best_cpu = float("inf"), float("inf")
    rounds = max(1, min(len(vectors) // batch, 1000 // batch if batch < 1000 else 4))
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        for start in range(rounds):
            await router.route_embeddings(vectors[start * batch : (start + 1) * batch])
        best = min(best, (time.perf_counter() - t0) / (rounds * batch) * 1e6)
        best_cpu = min(best_cpu, (time.process_time() - c0) / (rounds * batch) * 1e6)
    return best, best_cpu


async def batch1_ab(
    routers: dict[str, SemanticRoutingChatClient], vectors: np.ndarray, repeats: int
) -> dict[str, dict[str, float]]:
    """Interleaved A/B of `route_embeddings` at batch 1 (no encoder): every query row goes
    through each router in turn (the order reversed on every other row, so that no router
    always runs on a warmer cache), `repeats` passes over `vectors`. Per router: the median
    and the minimum of the per-call CPU time (this process) and wall time, in µs. The
    median resists other jobs' bursts; the minimum is the cost with nothing in the way."""
    rows = [np.ascontiguousarray(vectors[i : i + 1]) for i in range(len(vectors))]
    names = list(routers)
    cpu: dict[str, list[int]] = {name: [] for name in names}
    wall: dict[str, list[int]] = {name: [] for name in names}
    for row in rows[:200]:  # warm-up, not counted
        for name in names:
            await routers[name].route_embeddings(row)
    process_ns, perf_ns = time.process_time_ns, time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        for rep in range(repeats):
            for position, row in enumerate(rows):
                order = names if (position + rep) % 2 == 0 else names[::-1]
                for name in order:
                    router = routers[name]
                    c0, w0 = process_ns(), perf_ns()
                    await router.route_embeddings(row)
                    w1, c1 = perf_ns(), process_ns()
                    cpu[name].append(c1 - c0)
                    wall[name].append(w1 - w0)
    finally:
        gc.enable()
    return {
        name: {
            "cpu_median": float(np.median(cpu[name])) / 1e3,
            "cpu_min": float(np.min(cpu[name])) / 1e3,
            "wall_median": float(np.median(wall[name])) / 1e3,
            "wall_min": float(np.min(wall[name])) / 1e3,
            "calls": float(len(cpu[name])),
        }
        for name in names
    }


async def scoring_modes(
    args: argparse.Namespace,
    parts: dict[str, Any],
    cached: CachedGenerator,
    clients: dict[str, RouteClient],
    default: RouteClient,
    out: dict[str, Any],
) -> None:
    """One row per scoring mode: thresholds fitted on val + oos_val only, then the test."""
    profiles = {clients[n]: utts for n, utts in parts["profiles"].items()}
    queries = [q for q, _ in parts["queries"]]
    labels = [clients[t] if t is not None else None for _, t in parts["queries"]]
    query_vectors = np.asarray(await cached.generate(queries), dtype=np.float32)
    rows = []
    tuned_routers: dict[str, SemanticRoutingChatClient] = {}
    for mode in MODES:
        router, fitted, tuned = await calibrated(
            cached,
            profiles,
            default,
            mode,
            parts["val"],
            clients,
            score_threshold=args.default_threshold,
            leave_open=True,
        )
        decisions = await tuned.route_batch(queries)
        m = evaluate_decisions(decisions, labels, default_client=default)
        tuned_routers[mode] = tuned
        rows.append(
            {
                "mode": mode,
                "oos_score": fitted.oos_score,
                "top1": m.in_scope_top1,
                "in_scope": m.in_scope_accuracy,
                "oos_recall": m.no_route_recall,
                "overall": m.overall_accuracy,
                "train_s": router.training_seconds or 0.0,
            }
        )
    # Batch 1: an interleaved A/B of each learned mode (gating on its chosen score) against
    # the contract rule on the same profile index, so that both search the same vectors.
    sample = query_vectors[: args.ab_queries]
    load_before = os.getloadavg()[0]
    out["ab"] = {}
    for mode in MODES[1:]:
        contract = SemanticRoutingChatClient(
            cached,
            profiles,
            default,
            scoring="top_k",
            profile_index=tuned_routers[mode].profile_index,
            leave_open=True,
        )
        pair = {"top_k": contract, mode: tuned_routers[mode]}
        out["ab"][mode] = await batch1_ab(pair, sample, args.ab_repeats)
    out["ab_load"] = (load_before, os.getloadavg()[0])
    out["ab_queries"], out["ab_repeats"] = len(sample), args.ab_repeats
    # Batch 1,024: per-call overheads are amortised; best of 3 per mode.
    for row in rows:
        row["us_1024"], row["cpu_us_1024"] = await per_decision_us(
            tuned_routers[row["mode"]], query_vectors, 1024
        )
    base = next(row for row in rows if row["mode"] == "top_k")
    for row in rows:
        row["extra_us_1024"] = row["us_1024"] - base["us_1024"]
        row["extra_cpu_us_1024"] = row["cpu_us_1024"] - base["cpu_us_1024"]
    out["modes"] = rows
    out["modes_scaling"] = {mode: scaling_row(mode) for mode in ("prototype", "adapter")}


def scaling_row(
    mode: str, routes: int = 1000, per_route: int = 100, dimension: int = 384
) -> dict[str, float]:
    """Train `mode`'s head on synthetic clustered unit vectors: seconds, peak MiB."""
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((routes, dimension)).astype(np.float32)
    noise = rng.standard_normal((routes * per_route, dimension)).astype(np.float32)
    vectors = np.repeat(centres, per_route, axis=0) + 1.5 * noise
    groups = np.repeat(np.arange(routes, dtype=np.int64), per_route)
    index = ProfileIndex(vectors, labels=[f"r{g}" for g in groups])
    del vectors, noise
    gc.collect()
    tracemalloc.start()
    t0, c0 = time.perf_counter(), time.process_time()
    trained = index.trained(make_scoring(mode), groups)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert trained.head is not None
    return {"train_s": seconds, "cpu_s": cpu, "peak_mib": peak / 2**20, "rows": routes * per_route}


async def modes_main(args: argparse.Namespace, parts: dict[str, Any], out: dict[str, Any]) -> None:
    embedder = SentenceTransformerEmbedder("default", device=args.device)
    clients = {name: RouteClient(name) for name in parts["profiles"]}
    await scoring_modes(
        args, parts, CachedGenerator(embedder), clients, RouteClient("__default__"), out
    )
    await embedder.aclose()


def fmt(v: float, d: int = 1) -> str:
    return f"{v:.{d}f}"


def report_modes(args: argparse.Namespace, out: dict[str, Any]) -> str:
    """The scoring-mode table, the scaling line and semantic-router's row of the same run."""
    ab, load = out["ab"], out["ab_load"]
    lines: list[str] = []
    lines += [
        "",
        "Scoring modes (`scoring=`), thresholds fitted by `calibrate()` on val + oos_val only "
        "(3,100 queries), measured on test + oos_test (5,500). Each mode gates on the "
        "out-of-scope score `calibrate()` chose.",
        "",
        table(
            [
                "scoring",
                "OOS score chosen",
                "in-scope top-1 %",
                "in-scope accuracy %",
                "OOS recall %",
                "overall %",
                "training s",
            ],
            [
                [
                    r["mode"],
                    r["oos_score"],
                    fmt(100 * r["top1"]),
                    fmt(100 * r["in_scope"]),
                    fmt(100 * r["oos_recall"]),
                    fmt(100 * r["overall"]),
                    fmt(r["train_s"], 2),
                ]
                for r in out["modes"]
            ],
        ),
        "",
        "Cost per decision of `route_embeddings` (precomputed query embeddings, no encoder). "
        f"Batch 1: for each learned mode, an interleaved A/B against the contract rule "
        f"(`top_k`, top_k 1) on the same profile index: {out['ab_queries']:,} test queries x "
        f"{out['ab_repeats']} passes, the two routers alternating call by call, each call "
        "timed alone (CPU time of this process, and wall time). Extra = the mode's median "
        "(minimum) minus the contract rule's median (minimum) in the same A/B; the "
        "`top_k` row is the contract rule of the `prototype` A/B. Batch 1,024: best of 3 runs "
        "over the test queries. Load average (1 min) at the start / end of the A/Bs: "
        f"{load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores.",
        "",
        table(
            [
                "scoring",
                "b=1 CPU µs median / min",
                "b=1 wall µs median / min",
                "extra b=1 CPU µs median / min",
                "extra b=1 wall µs median / min",
                "b=1024 µs/decision wall / CPU",
                "extra b=1024 µs wall / CPU",
            ],
            [
                [
                    r["mode"],
                    f"{fmt(mine['cpu_median'])} / {fmt(mine['cpu_min'])}",
                    f"{fmt(mine['wall_median'])} / {fmt(mine['wall_min'])}",
                    f"{fmt(mine['cpu_median'] - base['cpu_median'])} / "
                    f"{fmt(mine['cpu_min'] - base['cpu_min'])}",
                    f"{fmt(mine['wall_median'] - base['wall_median'])} / "
                    f"{fmt(mine['wall_min'] - base['wall_min'])}",
                    f"{fmt(r['us_1024'], 2)} / {fmt(r['cpu_us_1024'], 2)}",
                    f"{fmt(r['extra_us_1024'], 2)} / {fmt(r['extra_cpu_us_1024'], 2)}",
                ]
                for r in out["modes"]
                for pair in [ab["prototype" if r["mode"] == "top_k" else r["mode"]]]
                for mine, base in [(pair[r["mode"]], pair["top_k"])]
            ],
        ),
    ]
    for mode, sc in out["modes_scaling"].items():
        lines += [
            "",
            f"Scaling: `{mode}` training on 1,000 routes x 100 utterances ({sc['rows']:,} "
            f"synthetic 384-d vectors): {sc['train_s']:.1f} s ({sc['cpu_s']:.1f} s CPU), "
            f"peak traced memory {sc['peak_mib']:.0f} MiB.",
        ]
    if "sr_acc" in out:
        sr = out["sr_acc"]
        lines += [
            "",
            f"semantic-router {out['sr_version']} in the same run (IndexedRouter + LocalEncoder, "
            f"top_k 5, mean, one threshold tuned on val + oos_val: {out['sr_threshold']:.2f}): "
            f"in-scope top-1 {100 * sr['top1']:.1f}%, OOS recall {100 * sr['oos_recall']:.1f}%, "
            f"overall {100 * sr['overall']:.1f}%.",
        ]
    return "\n".join(lines).strip() + "\n"
