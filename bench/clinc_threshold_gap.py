"""The best single threshold per scoring mode on CLINC150's validation split.

Run: `python bench/clinc_threshold_gap.py`. For each scoring mode the router (default model,
per-intent profiles of 20 training utterances, top_k 5 mean) scores val + oos_val, and one
threshold for every route is swept to maximise balanced accuracy (the mean of in-scope
accuracy and out-of-scope recall). The gap between the modes' best thresholds is what
bench/routing_sgd.py moves the service's default threshold by for `prototype`
(docs/conversations.md). Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from _common import load_clinc150, table
from routing_clinc150 import RouteClient, split

from chatroute import ScoreAggregation, SemanticRoutingChatClient, SentenceTransformerEmbedder


async def run(args: argparse.Namespace) -> str:
    parts = split(load_clinc150())
    names = list(parts["profiles"])
    clients = {name: RouteClient(name) for name in names}
    texts = [text for text, _ in parts["val"]]
    labels = np.array([names.index(i) if i is not None else -1 for _, i in parts["val"]])
    in_scope = labels >= 0
    grid = np.round(np.arange(0.0, 0.8, 0.01), 2)
    embedder = SentenceTransformerEmbedder(device=args.device)
    rows = []
    for mode in args.modes.split(","):
        router = SemanticRoutingChatClient(
            embedder,
            {clients[n]: parts["profiles"][n] for n in names},
            RouteClient("default"),
            top_k=5,
            score_aggregation=ScoreAggregation.MEAN,
            scoring=mode,
            leave_open=True,
        )
        columns = [router.clients.index(clients[n]) for n in names]
        scores = np.stack([s for s, _ in await router.score_routes(texts)])[:, columns]
        best, top = scores.argmax(axis=1), scores.max(axis=1)
        sweep = []
        for threshold in grid:
            accuracy = float(((best == labels) & (top >= threshold))[in_scope].mean())
            recall = float((top < threshold)[~in_scope].mean())
            sweep.append(((accuracy + recall) / 2, threshold, accuracy, recall))
        balanced, threshold, accuracy, recall = max(sweep)
        rows.append(
            [mode, f"{threshold:.2f}", f"{balanced:.3f}", f"{accuracy:.3f}", f"{recall:.3f}"]
        )
        print(rows[-1], flush=True)
    await embedder.aclose()
    return table(
        ["scoring", "best threshold", "balanced accuracy", "in-scope accuracy", "OOS recall"],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default="top_k,prototype,knn")
    parser.add_argument("--device", default="auto")
    print(asyncio.run(run(parser.parse_args())))


if __name__ == "__main__":
    main()
