"""Embedder throughput: raw SentenceTransformer.encode vs SentenceTransformerEmbedder.generate.

Texts: the CLINC150 test + oos_test queries (5,500). Modes, interleaved per round so that a
noisy machine hurts all of them alike:
  - raw: `SentenceTransformer.encode(texts, batch_size=256)` on the same model and device;
  - one call: `await embedder.generate(texts)`;
  - 64 callers: 64 coroutines each embedding single texts (`generate([text])`) until all
    texts are done, so the micro-batcher coalesces them.
Prints a markdown table (texts/s, median over rounds, and the ratio to raw encode).

Run from the repository root:
    HF_HUB_OFFLINE=1 .venv/bin/python bench/embedder_throughput.py [--rounds 3] [--limit N]
The data location defaults to ../shared/data/clinc150 relative to the repository root;
set CHATROUTE_CLINC150 (the folder or the data_full.json file) to override.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chatroute.embedder import SentenceTransformerEmbedder  # noqa: E402


def clinc150_file() -> Path:
    env = os.environ.get("CHATROUTE_CLINC150")
    path = Path(env) if env else REPO.parent / "shared" / "data" / "clinc150"
    if path.is_dir():
        path = path / "data_full.json"
    if not path.is_file():
        raise SystemExit(f"CLINC150 data not found at {path}; set CHATROUTE_CLINC150")
    return path


def load_texts(limit: int | None) -> list[str]:
    data = json.loads(clinc150_file().read_text())
    texts = [text for text, _label in data["test"] + data["oos_test"]]
    return texts[:limit] if limit else texts


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: str) -> str:
    desc = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    if device.startswith("cuda"):
        desc += f", GPU {torch.cuda.get_device_name(torch.device(device))}"
    return desc


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


async def callers(emb: SentenceTransformerEmbedder, texts: list[str], n: int) -> None:
    it = iter(range(len(texts)))
    out: list[np.ndarray | None] = [None] * len(texts)

    async def one() -> None:
        for i in it:
            out[i] = (await emb.generate([texts[i]]))[0]

    await asyncio.gather(*(one() for _ in range(n)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N texts")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--tokenizer-threads", type=int, default=None)
    args = parser.parse_args()

    texts = load_texts(args.limit)
    emb = SentenceTransformerEmbedder(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        tokenizer_threads=args.tokenizer_threads,
    )
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(emb._runner._folder.as_posix(), device=emb.device)  # type: ignore[union-attr]
    if emb.dtype != "fp32":
        st.to(emb._runner.dtype)
    batches: list[tuple[int, int]] = []
    emb.add_batch_listener(lambda size, tokens: batches.append((size, tokens)))

    # Warm both paths, and check they agree.
    ref = st.encode(texts[:512], batch_size=256)
    got = emb.embed_sync(texts[:512])
    max_diff = float(np.abs(ref - got).max())

    loop = asyncio.new_event_loop()
    modes: dict[str, Callable[[], object]] = {
        "raw `encode(batch_size=256)`": lambda: st.encode(texts, batch_size=256),
        "`generate(texts)`, one call": lambda: loop.run_until_complete(emb.generate(texts)),
        f"`generate([text])`, {args.callers} concurrent callers": lambda: loop.run_until_complete(
            callers(emb, texts, args.callers)
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in modes}
    batch_stats: dict[str, list[tuple[int, int]]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, fn in modes.items():
            batches.clear()
            rates[name].append(len(texts) / timed(fn))
            batch_stats[name] = list(batches)
    loop.run_until_complete(emb.aclose())
    loop.close()

    raw_name = next(iter(modes))
    raw = statistics.median(rates[raw_name])
    cmd = " ".join(
        shlex.quote(a) for a in ["python", "bench/embedder_throughput.py", *sys.argv[1:]]
    )
    print(f"Machine: {machine(emb.device)}; device {emb.device}, {emb.dtype}")
    print(
        f"Model: {emb.model}; {len(texts)} CLINC150 texts (test + oos_test); {args.rounds} rounds, interleaved"
    )
    print(
        f"Embedder: max_batch_size={emb.max_batch_size}, max_batch_tokens={emb.max_batch_tokens}, "
        f"tokenizer_threads={emb._threads}; max |embedder - encode| = {max_diff:.2e}"
    )
    print(f"Command: `{cmd}`\n")
    print("| mode | texts/s (median) | per round | vs raw encode | forward passes | mean batch |")
    print("|---|---:|---|---:|---:|---:|")
    for name in modes:
        med = statistics.median(rates[name])
        per_round = ", ".join(f"{r:.0f}" for r in rates[name])
        stats = batch_stats[name]
        n_batches = str(len(stats)) if stats else "-"
        mean_batch = f"{sum(s for s, _ in stats) / len(stats):.1f}" if stats else "-"
        print(
            f"| {name} | {med:.0f} | {per_round} | {med / raw:.2f}x | {n_batches} | {mean_batch} |"
        )


if __name__ == "__main__":
    main()
