"""Traced packed passes: the embedder's forward pass eager and traced, alone and beside a busy Python thread.

Run from the repository root:

    .venv/bin/python bench/traced_pass.py [--rounds 5] [--no-write]

Loads the default model on the CPU (`SentenceTransformerEmbedder(workers=1)`), packs the
first 640 CLINC150 test queries into 20 batches of 32 texts (rows of 64 tokens, as the
CPU default does) and times the 20 passes on one model thread, one intra-op thread:

- `eager`: `PackedPass`, the model's modules called from Python one operator at a time;
- `traced`: its TorchScript trace, what the embedder runs on a CPU once its probe passes
  showed the same vectors.

Each is timed alone and beside a pure-Python thread that never blocks (what an event loop
answering requests is, in bursts), `--rounds` rounds, the arms in turn; the figure is the
median over the rounds of the milliseconds a pass. The result is printed and written to
the `traced-pass` section of BENCHMARKS.md (`--no-write` to skip).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _common import REPO, command, load_clinc150, machine, table, write_section

from chatroute.embedder import SentenceTransformerEmbedder

TEXTS, PER_PASS, WIDTH = 640, 32, 64


def run(args: argparse.Namespace) -> str:
    texts = [q for q, _ in load_clinc150()["test"]][:TEXTS]
    embedder = SentenceTransformerEmbedder(workers=1)
    runner = embedder._runner
    if not runner.traced:
        raise SystemExit("the embedder did not trace its packed pass on this machine")
    traced = runner._pass
    eager = runner.packed_pass()
    batches = [
        runner.packed_batch(texts[start : start + PER_PASS], WIDTH)
        for start in range(0, TEXTS, PER_PASS)
    ]
    inputs = [runner._packed_inputs(b) for b in batches]
    with torch.inference_mode():
        diff = max(float((traced(*x) - eager(*x)).abs().max()) for x in inputs)

    def passes(module: object) -> float:
        """Milliseconds a pass, all batches once, on a fresh thread of one intra-op thread."""
        took: list[float] = []

        def work() -> None:
            torch.set_num_threads(1)
            with torch.inference_mode():
                began = time.perf_counter()
                for x in inputs:
                    module(*x)  # type: ignore[operator]
                took.append((time.perf_counter() - began) / len(inputs) * 1e3)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return took[0]

    stop = threading.Event()

    def busy() -> None:
        n = 0
        while not stop.is_set():
            for i in range(1000):
                n += i

    arms = {"eager": eager, "traced": traced}
    results: dict[tuple[str, bool], list[float]] = {(a, b): [] for a in arms for b in (False, True)}
    passes(traced)  # warm both
    passes(eager)
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            results[(name, False)].append(passes(arms[name]))
        stop.clear()
        spinner = threading.Thread(target=busy)
        spinner.start()
        try:
            for name in order:
                results[(name, True)].append(passes(arms[name]))
        finally:
            stop.set()
            spinner.join()
    embedder.close()
    med = {key: statistics.median(values) for key, values in results.items()}
    rows_out = [
        [
            name,
            f"{med[(name, False)]:.1f}",
            f"{med[(name, True)]:.1f}",
            f"{med[(name, True)] / med[(name, False)]:.2f}",
        ]
        for name in arms
    ]
    return (
        "## Traced packed passes (bench/traced_pass.py)\n\n"
        f"- Machine: {machine()}\n"
        f"- Command: `{command()}`\n"
        f"- {TEXTS} CLINC150 test queries in {len(batches)} packed passes of {PER_PASS} texts "
        f"(rows of {WIDTH} tokens), one model thread with one intra-op thread; median over "
        f"{args.rounds} rounds of the milliseconds a pass. Busy: a pure-Python thread that "
        "never blocks runs meanwhile. The traced and eager vectors differ by at most "
        f"{diff:.1e}.\n\n"
        + table(["pass", "alone ms", "beside a busy thread ms", "slowdown (x)"], rows_out)
        + f"\n\nTraced against eager: {med[('traced', False)] / med[('eager', False)]:.2f}x the "
        f"time alone, {med[('traced', True)] / med[('eager', True)]:.2f}x beside the busy "
        "thread.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    args = parser.parse_args()
    text = run(args)
    print(text)
    if not args.no_write:
        write_section(REPO / "BENCHMARKS.md", "traced-pass", text)


if __name__ == "__main__":
    main()
