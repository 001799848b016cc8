"""The embedder's batching under load: short texts packed into shared rows, passes held back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from chatroute.embedder import SentenceTransformerEmbedder
from chatroute.embedder._batcher import Batch, MicroBatcher, Request, Segment, pack_rows, plan_batch
from chatroute.embedder._model import ModelRunner
from tests.embedder_helpers import ForwardGate, until

ATOL = 1e-5
SHORT = [
    "hi",
    "reset my password",
    "what's the weather like in Lusaka tomorrow afternoon",
    "",
    "translate 'butter' into Italian",
    "Ünïcödé & symbols: €100 #tag @user :)",
    "book a table for two at eight",
]


def segment(req: Request, lengths: list[int]) -> Segment:
    order = np.argsort(np.array(lengths), kind="stable")
    return Segment(
        request=req,
        positions=order.astype(np.int64),
        lengths=np.array(lengths, dtype=np.int64)[order],
    )


def queue(batcher: MicroBatcher, lengths: list[int]) -> Request:
    req = Request(len(lengths))
    batcher.admit(req)
    batcher.add(segment(req, lengths))
    return req


class Parked:
    """Wraps a batcher's condition wait: records timeouts, says when a taker sits in it.

    With `advance`, a timed wait does not sleep but moves the batcher's clock on by its
    timeout (a fake clock: the bound is checked by counts, not by wall time)."""

    def __init__(self, batcher: MicroBatcher, monkeypatch: pytest.MonkeyPatch, *, advance: bool):
        self.now = 0.0
        self.timeouts: list[float] = []
        self.event = threading.Event()
        original = batcher._cond.wait

        def wait(timeout: float | None = None) -> bool:
            if timeout is not None:
                self.timeouts.append(timeout)
                if advance:
                    self.now += timeout
                    return False
            self.event.set()
            return original(timeout)

        monkeypatch.setattr(batcher._cond, "wait", wait)
        monkeypatch.setattr(batcher, "_clock", lambda: self.now)


def take_in_thread(batcher: MicroBatcher) -> tuple[threading.Thread, list[Batch | None]]:
    got: list[Batch | None] = []
    thread = threading.Thread(target=lambda: got.append(batcher.take(wait=True)), daemon=True)
    thread.start()
    return thread, got


# -- packing ---------------------------------------------------------------------------------------


def test_pack_rows_lays_every_text_in_one_row_without_overlap() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        width = int(rng.choice([8, 16, 32, 64]))
        lengths = rng.integers(1, width // 2 + 1, size=int(rng.integers(1, 60)))
        starts, rows, row_width = pack_rows(lengths, width)
        used = np.zeros(rows * row_width, dtype=np.int64)
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            assert start // row_width == (start + length - 1) // row_width  # within its row
            used[start : start + length] += 1
        assert used.max() == 1 and used.sum() == lengths.sum()
        assert row_width <= width + lengths.max()
    # Mixed short lengths: far fewer positions than padding each to the longest.
    starts, rows, row_width = pack_rows(np.arange(3, 13), 32)
    assert rows * row_width < 10 * 12 and rows * row_width <= 3 * 32


def test_the_plan_packs_short_texts_of_mixed_lengths_into_one_pass() -> None:
    lengths = np.array([3, 4, 5, 6, 9, 12, 14, 15, 30, 31], dtype=np.int64)

    def plan(head: int, pack_width: int) -> tuple[int, int]:
        return plan_batch(
            lengths,
            head=head,
            max_batch_size=100,
            max_batch_tokens=10_000,
            pass_cost=8,
            pack_width=pack_width,
        )

    assert plan(0, pack_width=0) == (0, 4)  # padded: cut by length
    assert plan(0, pack_width=32) == (0, 8)  # packed: every text up to half a row at once
    assert plan(8, pack_width=32) == (8, 10)  # longer texts stay padded, apart


def test_take_packs_short_texts_and_pads_long_ones() -> None:
    batcher = MicroBatcher(
        max_batch_size=64, max_batch_tokens=1000, max_queue=100, pass_cost=8, pack_width=32
    )
    queue(batcher, [3, 5, 7, 9, 12, 14, 30, 31])
    packed = batcher.take(wait=False)
    assert packed is not None and packed.width > 0 and packed.starts is not None
    assert sorted(packed.lengths.tolist()) == [3, 5, 7, 9, 12, 14]
    assert packed.padded_tokens == packed.rows * packed.width < 6 * 14
    padded = batcher.take(wait=False)
    assert padded is not None and padded.width == 0
    assert sorted(padded.lengths.tolist()) == [30, 31]
    assert padded.padded_tokens == 2 * 31


def test_every_pass_stays_within_the_budget_and_every_text_goes_once() -> None:
    rng = np.random.default_rng(1)
    for _ in range(400):
        width = int(rng.choice([16, 20, 32]))
        budget = int(rng.choice([width, 40, 50, 3 * width]))
        lengths = rng.integers(1, width, size=int(rng.integers(2, 30))).tolist()
        batcher = MicroBatcher(
            max_batch_size=64,
            max_batch_tokens=budget,
            max_queue=100,
            pass_cost=int(rng.choice([0, 8, 24])),
            pack_width=width,
        )
        req = queue(batcher, lengths)
        taken = []
        while (batch := batcher.take(wait=False)) is not None:
            assert batch.padded_tokens <= budget or batch.size == 1
            if batch.width:
                assert 2 * batch.max_len <= width and batch.starts is not None
            taken += [seg.positions[offs] for seg, offs in batch.parts]
        assert sorted(np.concatenate(taken).tolist()) == list(range(len(lengths)))
        assert req.queued == 0 and batcher.queue_depth == 0


async def test_the_default_model_packs_and_packed_passes_equal_padded_ones(
    make: Callable[..., SentenceTransformerEmbedder],
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert runner.packs  # the load-time probe found packed rows give the padded results
    emb = make(workers=1, pack_width=64)  # one model thread: the held pass holds the queue
    gate = ForwardGate(emb, monkeypatch)
    widths: list[int] = []
    launch = emb._runner.launch

    def record(batch: Batch) -> Any:
        widths.append(batch.width)
        return launch(batch)

    monkeypatch.setattr(emb._runner, "launch", record)

    first = asyncio.create_task(emb.generate(["held"]))
    await gate.wait_started()
    waiting = [asyncio.create_task(emb.generate([t])) for t in SHORT]
    await until(lambda: emb._batcher.ready == len(SHORT), "all waiting texts tokenised")
    gate.open()
    await first
    got = np.concatenate(await asyncio.gather(*waiting))
    assert len(widths) == 2 and widths[1] > 0  # the waiting texts went as one packed pass
    want = np.concatenate([runner.embed_direct([t]) for t in SHORT])  # one padded pass each
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_packing_is_refused_when_the_probe_differs(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "_pass", runner._pass)  # the probes below replace it
    assert runner._setup_packing()
    monkeypatch.setattr(
        runner, "_forward_packed", lambda batch: torch.zeros(batch.size, runner.dimension)
    )
    assert not runner._setup_packing()


# -- holding a pass back ---------------------------------------------------------------------------


def two_workers(max_wait: float) -> MicroBatcher:
    """A batcher for two model threads that may hold a pass back for `max_wait` seconds."""
    return MicroBatcher(
        max_batch_size=64, max_batch_tokens=1000, max_queue=100, max_wait=max_wait, workers=2
    )


def answered(batcher: MicroBatcher, count: int) -> None:
    """`count` one-text callers served in one pass and answered: on their way back."""
    for _ in range(count):
        queue(batcher, [4])
    done = batcher.take(wait=False)
    assert done is not None and done.size == count
    batcher.finished(done)


def test_a_free_worker_holds_a_small_pass_back_but_never_past_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batcher = two_workers(max_wait=0.02)
    parked = Parked(batcher, monkeypatch, advance=True)
    answered(batcher, 10)
    queue(batcher, [4] * 6)  # six of the ten come back together
    running = batcher.take(wait=True)
    assert running is not None and running.size == 6
    assert parked.timeouts == []  # more ready than its share of the 6 in flight: not held
    queue(batcher, [4])
    held = batcher.take(wait=True)  # 1 ready against a share of (6 + 1) // 2, 3 on their way
    assert held is not None and held.size == 1
    assert sum(parked.timeouts) == pytest.approx(0.02)  # held for the bound, no longer
    assert all(t <= 0.02 for t in parked.timeouts)
    # The three did not come: with as many in flight as then, it does not wait again.
    for batch in (running, held):
        batcher.finished(batch)
    held_for = len(parked.timeouts)
    queue(batcher, [4] * 6)
    running = batcher.take(wait=True)
    queue(batcher, [4])
    again = batcher.take(wait=True)
    assert running is not None and again is not None and again.size == 1
    assert len(parked.timeouts) == held_for


def test_a_free_worker_does_not_wait_for_texts_that_are_not_on_their_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 64 one-text callers split 60 / 4 between two passes: the four answered come back,
    # and nothing else can come while the 60 are in a pass. Holding the four for a share
    # of 32 would idle this worker for the whole bound on every pass.
    batcher = two_workers(max_wait=0.02)
    parked = Parked(batcher, monkeypatch, advance=True)
    queue(batcher, [4] * 60)
    running = batcher.take(wait=True)
    assert running is not None and running.size == 60
    for _ in range(4):
        queue(batcher, [4])
    small = batcher.take(wait=True)
    assert small is not None and small.size == 4
    assert parked.timeouts == []  # not held at all


def test_texts_arriving_while_a_worker_is_held_join_its_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batcher = two_workers(max_wait=60.0)
    parked = Parked(batcher, monkeypatch, advance=False)  # the clock stands still
    answered(batcher, 11)
    queue(batcher, [4] * 6)
    assert batcher.take(wait=True) is not None  # 6 texts in a running pass, 5 on their way
    thread, got = take_in_thread(batcher)
    for arrived in range(1, 6):
        parked.event.wait(30)  # the taker sits in its wait (a hang guard, not a timing)
        parked.event.clear()
        queue(batcher, [4])
        if arrived < 5:  # fewer ready than its share of (6 + ready) // 2: held again
            assert parked.event.wait(30) and thread.is_alive()
    thread.join(30)
    assert got and got[0] is not None and got[0].size == 5  # five callers, one pass


def test_the_end_of_the_other_pass_releases_a_held_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batcher = two_workers(max_wait=60.0)
    parked = Parked(batcher, monkeypatch, advance=False)
    answered(batcher, 8)
    queue(batcher, [4] * 6)
    running = batcher.take(wait=True)
    assert running is not None
    queue(batcher, [4])
    thread, got = take_in_thread(batcher)
    assert parked.event.wait(30) and thread.is_alive()  # held while the 6 run, 1 on its way
    batcher.finished(running)  # nothing else in flight now: go
    thread.join(30)
    assert got and got[0] is not None and got[0].size == 1
    assert batcher.running == 1


async def test_callers_arriving_during_a_pass_are_served_together_by_the_other_worker(
    make: Callable[..., SentenceTransformerEmbedder],
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emb = make(workers=2, batch_wait_ms=1000)
    await emb.generate([f"caller {i}" for i in range(11)])  # eleven callers, answered
    gate = ForwardGate(emb, monkeypatch)
    first = asyncio.create_task(emb.generate([f"held {i}" for i in range(6)]))
    await gate.wait_started()  # six texts held in one worker's pass
    parked = Parked(emb._batcher, monkeypatch, advance=False)  # the bound never passes
    texts = [f"text {i}" for i in range(5)]
    callers = []
    for i, text in enumerate(texts):
        if i:  # the free worker saw the last caller's text and sits in its wait again
            await until(parked.event.is_set, "the free worker held back")
        parked.event.clear()
        callers.append(asyncio.create_task(emb.generate([text])))
        await until(lambda: emb._batcher.ready + emb._batcher.running > 6, "text ready")
    got = await asyncio.gather(*callers)
    assert gate.sizes == [6, 5]  # the other worker took all five callers in one pass
    np.testing.assert_allclose(np.concatenate(got), runner.embed_direct(texts), atol=ATOL)
    gate.open()
    await first


def test_bad_batching_settings_are_value_errors(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    for settings, name in (
        ({"batch_wait_ms": -1}, "batch_wait_ms"),
        ({"batch_wait_ms": 5000}, "batch_wait_ms"),
        ({"batch_wait_ms": "soon"}, "batch_wait_ms"),
        ({"pack_width": -1}, "pack_width"),
        ({"pack_width": 1024, "max_batch_tokens": 512}, "pack_width"),
    ):
        with pytest.raises(ValueError, match=name):
            make(**settings)
    with pytest.raises(ValueError, match="max_wait"):
        MicroBatcher(max_batch_size=1, max_batch_tokens=1, max_queue=1, max_wait=float("nan"))
    with pytest.raises(ValueError, match="workers"):
        MicroBatcher(max_batch_size=1, max_batch_tokens=1, max_queue=1, workers=0)
