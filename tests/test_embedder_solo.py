"""Solo passes: a lone request's forward pass runs on every intra-op thread of the lead worker."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from chatroute.config import EmbedderConfig
from chatroute.embedder import SentenceTransformerEmbedder
from chatroute.embedder._batcher import (
    SOLO_ALWAYS,
    SOLO_JOIN,
    Batch,
    MicroBatcher,
    Request,
)
from chatroute.embedder._model import ModelRunner
from tests.embedder_helpers import until
from tests.test_embedder_batching import queue, segment

ATOL = 1e-5


def solo_batcher(**kwargs: Any) -> MicroBatcher:
    return MicroBatcher(
        max_batch_size=64, max_batch_tokens=1000, max_queue=100, workers=2, solo=True, **kwargs
    )


# -- the batcher -----------------------------------------------------------------------------------


def test_the_lead_takes_a_lone_batch_as_solo_and_the_other_worker_waits_it_out() -> None:
    batcher = solo_batcher(pass_cost=100)  # texts of any lengths share a pass
    queue(batcher, [4, 9])
    assert batcher.take(wait=False, worker=1) is None  # nothing runs: the lead's to take
    lone = batcher.take(wait=False, worker=0)
    assert lone is not None and lone.solo and lone.size == 2
    queue(batcher, [3])
    assert batcher.take(wait=False, worker=1) is None  # a solo pass has the cores
    batcher.finished(lone)
    assert batcher.take(wait=False, worker=1) is None  # idle again: still the lead's
    again = batcher.take(wait=False, worker=0)
    assert again is not None and again.solo and again.size == 1


def test_a_batch_is_not_solo_while_other_texts_are_in_flight() -> None:
    batcher = solo_batcher()
    tokenising = Request(1)
    batcher.admit(tokenising)  # admitted, its segment not ready yet
    queue(batcher, [4])
    first = batcher.take(wait=False, worker=0)
    assert first is not None and not first.solo  # another text is on its way
    batcher.add(segment(tokenising, [6]))
    second = batcher.take(wait=False, worker=1)  # a shared pass runs: the other may take
    assert second is not None and not second.solo and second.size == 1
    queue(batcher, [4])
    assert (third := batcher.take(wait=False, worker=0)) is not None and not third.solo


def test_a_larger_batch_is_solo_only_when_its_texts_came_to_an_idle_model() -> None:
    batcher = solo_batcher(pass_cost=100)
    many = [4] * (SOLO_ALWAYS + 1)
    queue(batcher, [4])
    running = batcher.take(wait=False, worker=0)
    assert running is not None and running.solo
    queue(batcher, many)  # steady load: callers come back while a pass computes
    batcher.finished(running)
    later = batcher.take(wait=False, worker=0)
    assert later is not None and later.size == len(many) and not later.solo
    queue(batcher, [5])  # a small batch may run solo whenever it came
    small = batcher.take(wait=False, worker=1)
    assert small is not None and not small.solo  # (the helper's: `later` runs)
    batcher.computed(later)  # its answers are on their way: the model is idle
    batcher.finished(small)
    queue(batcher, many)
    batcher.finished(later)
    assert (idle := batcher.take(wait=False, worker=0)) is not None and idle.solo


def test_a_helper_joins_a_solo_pass_once_enough_texts_wait() -> None:
    batcher = solo_batcher(pass_cost=100)
    queue(batcher, [4])
    lone = batcher.take(wait=False, worker=0)
    assert lone is not None and lone.solo
    queue(batcher, [4] * (SOLO_JOIN - 1))
    assert batcher.take(wait=False, worker=1) is None  # a few wait for the solo pass
    queue(batcher, [4])
    joined = batcher.take(wait=False, worker=1)  # enough: the cores are shared after all
    assert joined is not None and joined.size == SOLO_JOIN and not joined.solo


def test_a_waiting_helper_is_woken_only_once_a_pass_that_is_not_solo_runs() -> None:
    batcher = solo_batcher()
    got: list[Batch | None] = []
    helper = threading.Thread(
        target=lambda: got.append(batcher.take(wait=True, worker=1)), daemon=True
    )
    helper.start()
    queue(batcher, [4])
    helper.join(0.2)  # a hang guard on the other side, not a timing: it must not have taken
    assert helper.is_alive() and not got
    lone = batcher.take(wait=False, worker=0)
    assert lone is not None and lone.solo
    batcher.finished(lone)
    late = Request(1)
    batcher.admit(late)
    queue(batcher, [4])
    shared = batcher.take(wait=False, worker=0)
    assert shared is not None and not shared.solo
    batcher.add(segment(late, [7]))  # ready while a shared pass runs: the helper's
    helper.join(30)
    assert got and got[0] is not None and got[0].size == 1 and not got[0].solo
    batcher.close()


def test_without_solo_any_worker_takes_from_an_idle_queue() -> None:
    batcher = MicroBatcher(max_batch_size=64, max_batch_tokens=1000, max_queue=100, workers=2)
    queue(batcher, [4])
    batch = batcher.take(wait=False, worker=1)
    assert batch is not None and not batch.solo


def test_closing_releases_a_helper_that_defers() -> None:
    batcher = solo_batcher()
    queue(batcher, [4])
    got: list[Batch | None] = [Batch(parts=[], size=0, max_len=0)]
    helper = threading.Thread(
        target=lambda: got.__setitem__(0, batcher.take(wait=True, worker=1)), daemon=True
    )
    helper.start()
    batcher.close()
    helper.join(30)
    assert not helper.is_alive() and got[0] is None


# -- the embedder ----------------------------------------------------------------------------------


class ThreadLog:
    """Records, for each forward pass, the model thread, its intra-op threads and `solo`."""

    def __init__(
        self,
        emb: SentenceTransformerEmbedder,
        monkeypatch: pytest.MonkeyPatch,
        meet: tuple[int, ...] = (),
    ):
        """Passes numbered in `meet` (from 1) wait for each other: they must run at once."""
        self.passes: list[tuple[str, int, bool, int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.started = threading.Event()
        barrier = threading.Barrier(len(meet)) if meet else None
        original = emb._runner.launch

        def launch(batch: Batch) -> Any:
            name = threading.current_thread().name
            self.passes.append((name, torch.get_num_threads(), batch.solo, batch.size))
            self.started.set()
            self.hold.wait(60)
            if barrier is not None and len(self.passes) in meet:
                barrier.wait(60)  # a hang guard: broken (the pass fails) if it runs alone
            return original(batch)

        monkeypatch.setattr(emb._runner, "launch", launch)


async def test_a_lone_request_runs_on_the_lead_with_every_solo_thread(
    make: Callable[..., SentenceTransformerEmbedder],
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    texts = ["book a table for two", "what's my balance"]
    want = [runner.embed_direct([text]) for text in texts]
    emb = make(workers=2, solo_threads=2)
    log = ThreadLog(emb, monkeypatch)
    for text, expected in zip(texts, want, strict=True):
        np.testing.assert_allclose(await emb.generate([text]), expected, atol=ATOL)
    assert log.passes == [
        ("chatroute-embed-model-0", 2, True, 1),
        ("chatroute-embed-model-0", 2, True, 1),
    ]


async def test_callers_arriving_during_a_solo_pass_wait_for_it_then_run_side_by_side(
    make: Callable[..., SentenceTransformerEmbedder],
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    texts = [f"caller number {i}" for i in range(6)]
    want = runner.embed_direct(texts)
    emb = make(workers=2, solo_threads=2, batch_wait_ms=0, max_batch_size=3)
    log = ThreadLog(emb, monkeypatch, meet=(2, 3))  # the callers' two passes side by side
    log.hold.clear()
    first = asyncio.create_task(emb.generate(["the lone one"]))
    assert await asyncio.to_thread(log.started.wait, 60)
    callers = [asyncio.create_task(emb.generate([t])) for t in texts]
    await until(lambda: emb._batcher.ready == len(texts), "the callers' texts are ready")
    assert len(log.passes) == 1  # nobody started a pass beside the solo one
    log.hold.set()
    got = await asyncio.gather(*callers)
    await first
    np.testing.assert_allclose(np.concatenate(got), want, atol=ATOL)
    assert log.passes[0] == ("chatroute-embed-model-0", 2, True, 1)
    rest = log.passes[1:]
    assert sum(size for *_, size in rest) == len(texts)
    assert all(not solo and threads == 1 for _, threads, solo, _ in rest)  # each its share
    assert {name for name, *_ in rest} == {"chatroute-embed-model-0", "chatroute-embed-model-1"}


async def test_solo_threads_all_means_torch_s_intra_op_threads(
    make: Callable[..., SentenceTransformerEmbedder], monkeypatch: pytest.MonkeyPatch
) -> None:
    emb = make(workers=2, solo_threads="all")
    assert emb._solo_threads == (torch.get_num_threads() if torch.get_num_threads() > 1 else None)
    log = ThreadLog(emb, monkeypatch)
    await emb.generate(["hello"])
    assert log.passes[0][1] == max(1, torch.get_num_threads())


def test_bad_solo_threads_are_value_errors(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    for value in (0, -2, True, "many", 1.5):
        with pytest.raises(ValueError, match="solo_threads"):
            make(workers=2, solo_threads=value)


def test_the_library_default_and_one_thread_keep_passes_on_a_worker_s_share(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    for settings in ({}, {"solo_threads": 1}, {"solo_threads": 2, "workers": 1}):
        emb = make(**settings)
        assert emb._solo_threads is None and not emb._batcher.solo


def test_the_service_config_turns_solo_passes_on_and_validates_the_count() -> None:
    assert EmbedderConfig().solo_threads == "all"
    assert EmbedderConfig(solo_threads=1).solo_threads == 1
    for bad in (0, "some", True, 2.5):
        with pytest.raises(ValueError, match=r"'all' or a number of threads \(1 or more\)"):
            EmbedderConfig(solo_threads=bad)


def test_a_lead_that_is_gone_leaves_the_queue_to_the_others() -> None:
    batcher = solo_batcher()
    queue(batcher, [4])
    assert batcher.take(wait=False, worker=1) is None  # deferring to the lead
    batcher.end_solo()  # the lead's thread ended (its worker loop's `finally`)
    batch = batcher.take(wait=False, worker=1)
    assert batch is not None and not batch.solo


async def test_if_the_lead_thread_dies_the_other_worker_serves_every_caller(
    make: Callable[..., SentenceTransformerEmbedder],
    runner: ModelRunner,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    want = runner.embed_direct(["still answered"])
    original = SentenceTransformerEmbedder._serve

    def serve(self: SentenceTransformerEmbedder, index: int) -> None:
        if index == 0:
            raise RuntimeError("the lead's loop broke")  # a bug, not a failed pass
        original(self, index)

    monkeypatch.setattr(SentenceTransformerEmbedder, "_serve", serve)
    emb = make(workers=2, solo_threads=2)
    emb._workers[0].join(30)
    assert not emb._workers[0].is_alive()
    got = await asyncio.wait_for(emb.generate(["still answered"]), 60)
    np.testing.assert_allclose(got, want, atol=ATOL)
    assert "model thread 0 stopped" in caplog.text


def test_the_service_builds_its_embedder_with_the_configured_solo_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from chatroute.config import load_config
    from chatroute.engine import build_embedder

    seen: list[object] = []

    def fake(*args: Any, **kwargs: Any) -> object:
        seen.append(kwargs["solo_threads"])
        return object()

    monkeypatch.setattr("chatroute.embedder.SentenceTransformerEmbedder", fake)
    config = load_config("examples/chatroute.yaml", environ={})  # no solo_threads key
    build_embedder(config)
    build_embedder(config.model_copy(update={"embedder": EmbedderConfig(solo_threads=1)}))
    assert seen == ["all", 1]
