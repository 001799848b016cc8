"""GPU checks and GPU benchmark in one script: correctness asserts, then throughput/latency.

Meant for a machine with CUDA, torch and sentence-transformers (faiss and the server stack
are optional: the engine imports without them). It exits non-zero when a check fails and
writes `gpu_check.json` and `gpu_check.md` into --out.

    python bench/gpu_check.py --model MODEL_DIR --data data_full.json --out OUT_DIR

MODEL_DIR is a sentence-transformers folder of all-MiniLM-L6-v2 (an fp16 copy is fine);
--data is CLINC150's data_full.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from chatroute import (
    ChatClient,
    ChatMessage,
    ChatRole,
    ProfileIndex,
    ScoreAggregation,
    SemanticRoutingChatClient,
    SentenceTransformerEmbedder,
)


class _Target(ChatClient):
    """A route target; only decisions are asked for."""

    async def get_response(self, messages: Any, options: Any = None) -> Any:
        raise NotImplementedError

    def get_streaming_response(self, messages: Any, options: Any = None) -> Any:
        raise NotImplementedError


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def check_embeddings(args: argparse.Namespace, texts: list[str], out: dict[str, Any]) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(args.model, device="cuda").float()
    expected = reference.encode(texts[:2000], batch_size=256, normalize_embeddings=True)
    for dtype in ("fp16", "bf16", "fp32"):
        emb = SentenceTransformerEmbedder(args.model, device="cuda", dtype=dtype)
        got = asyncio.run(emb.generate(texts[:2000]))
        cos = np.sum(got * expected, axis=1)
        out[f"embed_{dtype}_min_cosine"] = float(cos.min())
        emb.close()
        floor = 0.999 if dtype == "fp32" else 0.99
        assert cos.min() >= floor, f"{dtype}: min cosine {cos.min():.5f} < {floor}"
    del reference


def check_index(out: dict[str, Any]) -> None:
    rng = np.random.default_rng(3)
    bank = rng.standard_normal((3000, 384)).astype(np.float32)
    bank[1500] = bank[10]  # an exact tie: the lower id must win on every backend
    queries = rng.standard_normal((500, 384)).astype(np.float32)
    queries[0] = bank[10]
    cpu = ProfileIndex(bank, device="cpu", backend="torch")
    gpu = ProfileIndex(bank, device="cuda", backend="torch")
    _, i1 = cpu.search(queries, 5)
    _, i2 = gpu.search(queries, 5)
    assert np.array_equal(i1, i2), "torch-on-CUDA top-5 differs from CPU"
    assert i2[0][0] == 10, "tie not broken by the lower profile id on CUDA"
    out["index_torch_cuda_equal"] = True
    try:
        import faiss  # noqa: F401

        ref = ProfileIndex(bank, device="cpu", backend="faiss")
        _, i3 = ref.search(queries, 5)
        assert np.array_equal(i3, i2), "FAISS CPU and torch-on-CUDA top-5 differ"
        out["index_faiss_equal"] = True
        auto = ProfileIndex(bank, device="cuda")
        out["index_auto_backend_on_cuda"] = auto.backend
    except ImportError:
        out["index_faiss_equal"] = "faiss not installed"


def bench(args: argparse.Namespace, data: dict[str, Any], out: dict[str, Any]) -> None:
    from sentence_transformers import SentenceTransformer

    profiles: dict[str, list[str]] = {}
    for text, intent in data["train"]:
        bucket = profiles.setdefault(intent, [])
        if len(bucket) < 20:
            bucket.append(text)
    queries = [t for t, _ in data["test"]] + [t for t, _ in data["oos_test"]]
    many = (queries * (args.queries // len(queries) + 1))[: args.queries]

    raw = SentenceTransformer(args.model, device="cuda").half()
    raw.encode(queries[:2048], batch_size=1024)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    raw.encode(many, batch_size=1024)
    torch.cuda.synchronize()
    out["raw_encode_fp16_qps"] = len(many) / (time.perf_counter() - t0)
    lat = []
    for q in queries[:300]:
        t0 = time.perf_counter()
        raw.encode([q])
        lat.append((time.perf_counter() - t0) * 1000)
    out["raw_single_encode_p50_ms"] = statistics.median(lat)
    del raw

    async def run() -> None:
        emb = SentenceTransformerEmbedder(args.model, device="cuda", dtype=args.dtype)
        clients = {_Target(): u for u in profiles.values()}
        router = SemanticRoutingChatClient(
            emb, clients, _Target(), top_k=5, score_aggregation=ScoreAggregation.MEAN
        )
        await router.route_batch(queries[:1024])
        best = 0.0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            decisions = await router.route_batch(many)
            best = max(best, len(many) / (time.perf_counter() - t0))
        assert len(decisions) == len(many)
        out["route_batch_qps"] = best
        out["index_backend"] = router.profile_index.backend if router.profile_index else None
        lat = []
        for q in random.Random(5).sample(queries, 500):
            msgs = [ChatMessage(ChatRole.USER, q)]
            t0 = time.perf_counter()
            await router.route(msgs)
            lat.append((time.perf_counter() - t0) * 1000)
        out["route_p50_ms"], out["route_p99_ms"] = _pct(lat, 0.5), _pct(lat, 0.99)
        # 64 concurrent single decisions: the micro-batcher's case
        sample = random.Random(9).sample(queries, 4096)
        sem = asyncio.Semaphore(64)

        async def one(q: str) -> None:
            async with sem:
                await router.route([ChatMessage(ChatRole.USER, q)])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(q) for q in sample))
        out["route_concurrent64_qps"] = len(sample) / (time.perf_counter() - t0)
        await emb.aclose()

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--queries", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
    }
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    data = json.loads(Path(args.data).read_text(encoding="utf-8"))
    texts = [t for t, _ in data["test"]] + [t for t, _ in data["oos_test"]]
    failures = []
    for name, step in (
        ("embeddings", lambda: check_embeddings(args, texts, out)),
        ("index", lambda: check_index(out)),
        ("bench", lambda: bench(args, data, out)),
    ):
        try:
            step()
        except Exception as exc:  # report every failing step, then exit non-zero
            failures.append(f"{name}: {exc!r}")
        (outdir / "gpu_check.json").write_text(json.dumps(out, indent=2), encoding="utf-8")
    out["failures"] = failures
    lines = [f"GPU: {out['gpu']}, torch {out['torch']}. Command: `{out['command']}`", ""]
    lines += [f"- {k}: {v}" for k, v in out.items() if k not in ("gpu", "torch", "command")]
    (outdir / "gpu_check.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (outdir / "gpu_check.json").write_text(json.dumps(out, indent=2), encoding="utf-8")
    print("\n".join(lines))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
