"""CLINC150 check: a query routed alone (the batch-1 latency path) decides as in a batch.

For each learned scoring mode, thresholds fitted by `calibrate()` on val + oos_val (as in
routing_clinc150.py), every test + oos_test query (5,500) is routed alone and in one batch
from the same embeddings. Prints, per mode, how many decisions differ in client, winner or
default, in the set of reported routes, and the largest difference of `score` and of any
reported route's score.

Run: `python bench/one_query_check.py` (CPU, about a minute of embedding).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _clinc150 import CachedGenerator, RouteClient, calibrated, split
from _common import load_clinc150

from chatroute import SentenceTransformerEmbedder


async def main() -> None:
    parts = split(load_clinc150())
    cached = CachedGenerator(SentenceTransformerEmbedder("default", device="cpu"))
    clients = {name: RouteClient(name) for name in parts["profiles"]}
    profiles = {clients[n]: utts for n, utts in parts["profiles"].items()}
    default = RouteClient("__default__")
    vectors = await cached.generate([q for q, _ in parts["queries"]])
    for mode in ("knn", "prototype", "adapter"):
        _, fitted, tuned = await calibrated(cached, profiles, default, mode, parts["val"], clients)
        batch = await tuned.route_embeddings(vectors)
        alone = [(await tuned.route_embeddings(vectors[i : i + 1]))[0] for i in range(len(batch))]
        pairs = list(zip(alone, batch, strict=True))
        routes = sum(
            (a.client, a.winner, a.is_default) != (b.client, b.winner, b.is_default)
            for a, b in pairs
        )
        reported = sum(a.scores.keys() != b.scores.keys() for a, b in pairs)
        score = max(abs((a.score or 0.0) - (b.score or 0.0)) for a, b in pairs)
        each = max(
            abs(value - b.scores[client])
            for a, b in pairs
            for client, value in a.scores.items()
            if client in b.scores
        )
        print(
            f"{mode} (oos_score {fitted.oos_score}): {len(batch)} queries, "
            f"{routes} differ in client/winner/default, {reported} in the reported routes; "
            f"largest |score| difference {score:.2e}, of a reported route's {each:.2e}"
        )
    await cached.inner.aclose()


if __name__ == "__main__":
    asyncio.run(main())
