"""SentenceTransformerEmbedder: equality with encode, micro-batching, drops, overload, close."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chatroute.embedder import (
    EmbedderClosedError,
    EmbedderLoadError,
    EmbedderOverloadedError,
    SentenceTransformerEmbedder,
    _locate,
)
from chatroute.embedder._batcher import MicroBatcher, Request, Segment, plan_batch
from chatroute.embedder._model import ModelRunner
from tests.embedder_helpers import ForwardGate, until

ATOL = 1e-5
LONG = " ".join(f"word{i} and some more text" for i in range(200))  # far over 256 tokens
MIXED = [
    "hi",
    "how do I reset my password",
    "",
    "what's the weather going to be like in Lusaka tomorrow afternoon? Should I bring an umbrella?",
    LONG,
    "translate 'butter' into Italian",
    "Ünïcödé & symbols: €100 #tag @user :)",
]


@pytest.fixture(scope="module")
def reference(runner: ModelRunner) -> Callable[[list[str]], np.ndarray]:
    """Plain `SentenceTransformer(path).encode`, one text at a time (unbatched)."""
    from sentence_transformers import SentenceTransformer

    assert runner._folder is not None
    st = SentenceTransformer(str(runner._folder), device="cpu")
    cache: dict[str, np.ndarray] = {}

    def encode(texts: list[str]) -> np.ndarray:
        for text in texts:
            if text not in cache:
                cache[text] = st.encode([text], normalize_embeddings=True)[0]
        return np.stack([cache[t] for t in texts])

    return encode


def record_batches(emb: SentenceTransformerEmbedder) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    emb.add_batch_listener(lambda size, tokens: seen.append((size, tokens)))
    return seen


# -- model, identity ----------------------------------------------------------------------------


async def test_default_model_description(make: Callable[..., SentenceTransformerEmbedder]) -> None:
    emb = make()
    assert emb.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert emb.dimension == 384
    assert emb.device == "cpu"
    assert emb.dtype == "fp32"
    assert emb.max_seq_length == 256
    assert emb._runner.fast  # the tokenise-and-forward path, not encode()
    assert emb.queue_depth == 0


def test_fingerprint_is_stable_and_hashes_the_weights(
    make: Callable[..., SentenceTransformerEmbedder], runner: ModelRunner
) -> None:
    a, b = make(), make()
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint is a.fingerprint  # computed once
    fp = a.fingerprint
    assert fp.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert fp.dimension == 384
    assert fp.normalized is True
    assert runner._folder is not None
    weights = (runner._folder / "model.safetensors").read_bytes()
    assert fp.weights_sha256 == hashlib.sha256(weights).hexdigest()


# -- equality with encode -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "texts",
    [
        pytest.param(["how do I reset my password"], id="single"),
        pytest.param(MIXED, id="mixed-lengths"),
        pytest.param([LONG, LONG + " tail that is cut off"], id="over-long"),
        pytest.param([f"query number {i} about topic {i % 7}" for i in range(40)], id="batched"),
    ],
)
async def test_generate_equals_encode(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
    texts: list[str],
) -> None:
    emb = make()
    got = await emb.generate(texts)
    assert got.dtype == np.float32
    assert got.shape == (len(texts), 384)
    np.testing.assert_allclose(got, reference(texts), atol=ATOL)


async def test_over_long_text_is_truncated_not_refused(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    emb = make()
    seen = record_batches(emb)
    got = await emb.generate([LONG, LONG + " and a different ending"])
    assert seen == [(2, 2 * 256)]  # both rows cut to max_seq_length tokens
    np.testing.assert_allclose(got[0], got[1], atol=ATOL)  # the tails beyond it are ignored


async def test_sync_embed_shares_the_forward_path(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
) -> None:
    emb = make()
    seen = record_batches(emb)
    got = await asyncio.to_thread(emb.embed_sync, MIXED)
    np.testing.assert_allclose(got, reference(MIXED), atol=ATOL)
    assert sum(size for size, _ in seen) == len(MIXED)


async def test_encode_fallback_path_equals_encode(
    runner: ModelRunner, reference: Callable[[list[str]], np.ndarray]
) -> None:
    """Models the fast path cannot serve go through encode() per batch, same results."""
    slow = ModelRunner.__new__(ModelRunner)
    slow.__dict__.update(runner.__dict__)
    slow.fast = False
    emb = SentenceTransformerEmbedder(_runner=slow, warmup=False)
    try:
        got = await asyncio.gather(*(emb.generate([t]) for t in MIXED), emb.generate(MIXED))
        np.testing.assert_allclose(np.concatenate(got[:-1]), reference(MIXED), atol=ATOL)
        np.testing.assert_allclose(got[-1], reference(MIXED), atol=ATOL)
    finally:
        await emb.aclose()


async def test_large_call_is_split_by_budget_and_reassembled_in_order(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
) -> None:
    emb = make(max_batch_size=16, max_batch_tokens=256)
    seen = record_batches(emb)
    texts = [" ".join(["word"] * (1 + (i * 7) % 30)) + f" {i}" for i in range(80)]
    got = await emb.generate(texts)
    np.testing.assert_allclose(got, reference(texts), atol=ATOL)
    assert sum(size for size, _ in seen) == len(texts)
    assert len(seen) >= len(texts) // 16
    assert all(size <= 16 and tokens <= 256 for size, tokens in seen)


async def test_empty_input_gives_an_empty_matrix(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    emb = make()
    out = await emb.generate([])
    assert out.shape == (0, 384) and out.dtype == np.float32
    assert emb.embed_sync([]).shape == (0, 384)


@pytest.mark.parametrize("bad", ["a plain string", b"bytes", ["ok", 3], [None], 42])
async def test_non_string_input_is_a_type_error(
    make: Callable[..., SentenceTransformerEmbedder], bad: Any
) -> None:
    emb = make()
    with pytest.raises(TypeError):
        await emb.generate(bad)
    with pytest.raises(TypeError):
        emb.embed_sync(bad)
    assert emb.queue_depth == 0


def test_bad_settings_are_value_errors(make: Callable[..., SentenceTransformerEmbedder]) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        make(max_batch_size=0)
    with pytest.raises(ValueError, match="max_seq_length"):
        make(max_batch_tokens=100)
    with pytest.raises(ValueError, match="max_queue"):
        make(max_queue=-1)
    with pytest.raises(ValueError, match="tokenizer_threads"):
        make(tokenizer_threads=0)
    with pytest.raises(ValueError, match="dtype"):
        SentenceTransformerEmbedder(device="cpu", dtype="fp16")
    with pytest.raises(ValueError, match="dtype"):
        SentenceTransformerEmbedder(device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="device"):
        SentenceTransformerEmbedder(device="tpu")
    with pytest.raises(ValueError, match="model"):
        SentenceTransformerEmbedder(model="  ")


# -- load failures -------------------------------------------------------------------------------


def test_unloadable_model_names_it_and_says_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EmbedderLoadError) as err:
        SentenceTransformerEmbedder("no-such-org/no-such-embedding-model")
    message = str(err.value)
    assert "no-such-org/no-such-embedding-model" in message
    assert "offline" in message and "HF_HUB_OFFLINE" in message


def test_missing_local_folder_is_a_load_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(_locate, "_reachable", lambda host, port: False)
    missing = str(tmp_path / "no-model-here")
    with pytest.raises(EmbedderLoadError) as err:
        SentenceTransformerEmbedder(missing)
    assert missing in str(err.value)
    assert "offline: huggingface.co cannot be reached" in str(err.value)


def test_offline_state_reports_reachability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "true")
    assert "TRANSFORMERS_OFFLINE" in _locate.offline_state()
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    monkeypatch.setattr(_locate, "_reachable", lambda host, port: True)
    assert "online" in _locate.offline_state()


# -- micro-batching -------------------------------------------------------------------------------


async def test_concurrent_calls_are_coalesced_into_one_pass(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emb = make(workers=1)  # one model thread: the held pass holds the queue
    gate = ForwardGate(emb, monkeypatch)
    seen = record_batches(emb)
    first = asyncio.create_task(emb.generate(["the first request"]))
    await gate.wait_started()  # it went alone, at once
    # Equal token lengths, so the length plan has no reason to cut them apart.
    groups = [
        ["good morning", "thank you"],
        ["red car"],
        ["big dog", "hot tea", "my cat"],
        ["go home"],
    ]
    waiting = [asyncio.create_task(emb.generate(g)) for g in groups]
    total = sum(len(g) for g in groups)
    await until(lambda: emb._batcher.ready == total, "all waiting texts tokenised")
    assert emb.queue_depth == total
    gate.open()
    results = await asyncio.gather(first, *waiting)
    assert [size for size, _ in seen] == [1, total]  # 4 callers, one forward pass
    np.testing.assert_allclose(results[0], reference(["the first request"]), atol=ATOL)
    for group, got in zip(groups, results[1:], strict=True):
        np.testing.assert_allclose(got, reference(group), atol=ATOL)
    assert emb.queue_depth == 0


async def test_a_lone_request_never_waits_on_a_timer(
    make: Callable[..., SentenceTransformerEmbedder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Structural: the batcher's only waits are untimed (it sleeps only while nothing is
    ready), and a lone request is taken as a batch of its own."""
    emb = make()
    cond = emb._batcher._cond
    original_wait = cond.wait
    timeouts: list[float | None] = []
    parked = threading.Event()  # the model thread sits in the batcher's wait

    def wait(timeout: float | None = None) -> bool:
        timeouts.append(timeout)
        parked.set()
        try:
            return original_wait(timeout)
        finally:
            parked.clear()

    monkeypatch.setattr(cond, "wait", wait)
    await emb.generate(["cycle the model thread into the patched wait"])
    seen = record_batches(emb)
    for text in ["one", "two", "three"]:
        await until(parked.is_set, "the model thread idle")
        await emb.generate([text])
    assert [size for size, _ in seen] == [1, 1, 1]
    assert timeouts and all(t is None for t in timeouts)

    # And the policy itself: one ready text is a batch, with nothing to wait for.
    batcher = MicroBatcher(max_batch_size=8, max_batch_tokens=64, max_queue=10)
    req = Request(1)
    batcher.admit(req)
    batcher.add(segment(req, [5]))
    batch = batcher.take(wait=False)
    assert batch is not None and batch.size == 1
    assert batcher.take(wait=False) is None


async def test_cancelled_waiting_caller_is_dropped(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emb = make(workers=1)  # one model thread: the held pass holds the queue
    gate = ForwardGate(emb, monkeypatch)
    seen = record_batches(emb)
    first = asyncio.create_task(emb.generate(["in flight"]))
    await gate.wait_started()
    doomed = asyncio.create_task(emb.generate(["cancel me", "and me"]))
    kept = asyncio.create_task(emb.generate(["keep me"]))
    await until(lambda: emb._batcher.ready == 3, "waiting texts tokenised")
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert emb.queue_depth == 1
    gate.open()
    await first
    np.testing.assert_allclose(await kept, reference(["keep me"]), atol=ATOL)
    assert [size for size, _ in seen] == [1, 1]  # the cancelled texts were never computed


async def test_cancelling_an_in_flight_caller_does_not_break_the_batcher(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emb = make()
    gate = ForwardGate(emb, monkeypatch)
    running = asyncio.create_task(emb.generate(["being computed"]))
    await gate.wait_started()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    gate.open()
    np.testing.assert_allclose(await emb.generate(["after"]), reference(["after"]), atol=ATOL)


async def test_two_workers_run_passes_side_by_side(
    make: Callable[..., SentenceTransformerEmbedder],
    reference: Callable[[list[str]], np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emb = make(workers=2)
    assert emb.workers == 2
    gate = ForwardGate(emb, monkeypatch)
    held = asyncio.create_task(emb.generate(["held in the first worker"]))
    await gate.wait_started()
    # The other worker serves the next callers while the first pass is held.
    texts = ["served by the second worker", "and this one", "hello"]
    np.testing.assert_allclose(await emb.generate(texts), reference(texts), atol=ATOL)
    assert not held.done()
    gate.open()
    got = await held
    np.testing.assert_allclose(got, reference(["held in the first worker"]), atol=ATOL)
    # Many callers over both workers: every row lands in its own caller's answer.
    many = [f"request number {i} " + "word " * (i % 9) for i in range(40)]
    answers = await asyncio.gather(*(emb.generate([t]) for t in many))
    np.testing.assert_allclose(np.concatenate(answers), reference(many), atol=ATOL)


def test_cpu_workers_share_the_intra_op_threads_and_keep_the_default(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    import torch

    def fresh_thread_default() -> int:
        seen: list[int] = []
        probe = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        probe.start()
        probe.join()
        return seen[0]

    before_here, before_new = torch.get_num_threads(), fresh_thread_default()
    emb = make(workers=2)
    in_worker: list[int] = []
    emb.add_batch_listener(lambda size, tokens: in_worker.append(torch.get_num_threads()))
    emb.embed_sync(["which thread count runs this"])
    assert in_worker == [max(1, before_here // 2)]
    # The caller's thread and threads started later keep the process default.
    assert torch.get_num_threads() == before_here
    assert fresh_thread_default() == before_new


async def test_full_queue_refuses_with_overloaded_error(
    make: Callable[..., SentenceTransformerEmbedder], monkeypatch: pytest.MonkeyPatch
) -> None:
    emb = make(max_queue=4, workers=1)  # one model thread: the held pass holds the queue
    gate = ForwardGate(emb, monkeypatch)
    first = asyncio.create_task(emb.generate(["in flight"]))
    await gate.wait_started()
    assert emb.queue_depth == 0  # taken into the pass
    queued = asyncio.create_task(emb.generate(["a", "b", "c"]))
    await until(lambda: emb.queue_depth == 3, "three texts queued")
    with pytest.raises(EmbedderOverloadedError, match="max_queue"):
        await emb.generate(["d", "e"])
    with pytest.raises(EmbedderOverloadedError):
        emb.embed_sync(["d", "e"])
    fits = asyncio.create_task(emb.generate(["d"]))
    await until(lambda: emb.queue_depth == 4, "four texts queued")
    gate.open()
    assert (await queued).shape == (3, 384)
    assert (await fits).shape == (1, 384)
    await first
    # A request larger than the bound alone is still served by an idle embedder.
    assert (await emb.generate([f"t{i}" for i in range(10)])).shape == (10, 384)


async def test_aclose_fails_pending_callers_and_is_idempotent(
    make: Callable[..., SentenceTransformerEmbedder], monkeypatch: pytest.MonkeyPatch
) -> None:
    emb = make(workers=1)  # one model thread: the held pass holds the queue
    gate = ForwardGate(emb, monkeypatch)
    running = asyncio.create_task(emb.generate(["in flight"]))
    await gate.wait_started()
    waiting = asyncio.create_task(emb.generate(["waiting"]))
    await until(lambda: emb.queue_depth == 1, "a waiting caller")
    closing = asyncio.create_task(emb.aclose())
    for task in (running, waiting):
        with pytest.raises(EmbedderClosedError, match="closed"):
            await task
    gate.open()
    await closing
    await emb.aclose()
    emb.close()
    assert emb.closed and not any(w.is_alive() for w in emb._workers)
    with pytest.raises(EmbedderClosedError):
        await emb.generate(["late"])
    with pytest.raises(EmbedderClosedError):
        emb.embed_sync(["late"])


async def test_listener_errors_are_logged_not_raised(
    make: Callable[..., SentenceTransformerEmbedder], caplog: pytest.LogCaptureFixture
) -> None:
    emb = make()

    def broken(size: int, tokens: int) -> None:
        raise ValueError("listener bug")

    emb.add_batch_listener(broken)
    seen = record_batches(emb)
    with caplog.at_level(logging.ERROR, logger="chatroute.embedder"):
        out = await emb.generate(["still served"])
    assert out.shape == (1, 384)
    assert seen == [(1, seen[0][1])] and seen[0][1] > 0
    assert "listener" in caplog.text


def test_listener_can_be_removed(make: Callable[..., SentenceTransformerEmbedder]) -> None:
    emb = make()
    seen: list[int] = []
    remove = emb.add_batch_listener(lambda size, tokens: seen.append(size))
    emb.embed_sync(["x"])
    remove()
    emb.embed_sync(["y"])
    assert seen == [1]
    with pytest.raises(TypeError):
        emb.add_batch_listener("not callable")  # type: ignore[arg-type]


def test_embed_sync_from_the_model_thread_is_refused(
    make: Callable[..., SentenceTransformerEmbedder],
) -> None:
    emb = make()
    errors: list[BaseException] = []

    def reenter(size: int, tokens: int) -> None:
        try:
            emb.embed_sync(["nested"])
        except RuntimeError as exc:
            errors.append(exc)

    emb.add_batch_listener(reenter)
    emb.embed_sync(["outer"])
    assert errors and "model thread" in str(errors[0])


# -- the batching policy (no model) ---------------------------------------------------------------


def segment(req: Request, lengths: list[int], start: int = 0) -> Segment:
    order = np.argsort(np.array(lengths), kind="stable")
    return Segment(
        request=req,
        positions=(order + start).astype(np.int64),
        lengths=np.array(lengths, dtype=np.int64)[order],
    )


def test_batches_group_similar_lengths_within_the_budget() -> None:
    batcher = MicroBatcher(max_batch_size=4, max_batch_tokens=40, max_queue=100, pass_cost=8)
    req = Request(12)
    batcher.admit(req)
    lengths = [3, 30, 4, 29, 5, 28, 3, 31, 6, 27, 4, 8]
    batcher.add(segment(req, lengths))
    taken: list[list[int]] = []
    while (batch := batcher.take(wait=False)) is not None:
        assert batch.size <= 4 and batch.padded_tokens <= 40
        assert batch.padded_tokens == batch.size * max(batch.lengths)
        taken.append(sorted(batch.lengths.tolist()))
    assert sorted(x for b in taken for x in b) == sorted(lengths)
    # Short texts share passes; a long text never pads a short one (40-token budget).
    assert taken == [[3, 3, 4, 4], [5, 6, 8], [27], [28], [29], [30], [31]]
    assert batcher.queue_depth == 0 and batcher.ready == 0


def test_batch_plan_trades_padding_against_the_cost_of_a_pass() -> None:
    lengths = np.array([5, 5, 6, 7, 9, 9, 9, 12, 20, 21, 30], dtype=np.int64)

    def plan(head: int, pass_cost: int, size: int = 100) -> tuple[int, int]:
        return plan_batch(
            lengths, head=head, max_batch_size=size, max_batch_tokens=10_000, pass_cost=pass_cost
        )

    assert plan(0, pass_cost=0) == (0, 2)  # free passes: one length per pass, no padding
    assert plan(0, pass_cost=30) == (0, 7)  # 5..9 together
    assert plan(8, pass_cost=30) == (7, 11)  # the pass holding the head (length 20)
    assert plan(8, pass_cost=10_000) == (0, 11)  # costly passes: everything at once
    assert plan(4, pass_cost=10_000, size=3) == (4, 7)  # capped rows, from the head's length
    same = np.full(10, 4, dtype=np.int64)
    assert plan_batch(same, head=0, max_batch_size=3, max_batch_tokens=99, pass_cost=5) == (0, 3)


def test_the_oldest_request_is_in_every_batch() -> None:
    batcher = MicroBatcher(max_batch_size=2, max_batch_tokens=1000, max_queue=100)
    old, new = Request(3), Request(6)
    for req in (old, new):
        batcher.admit(req)
    batcher.add(segment(old, [50, 2, 50]))
    batcher.add(segment(new, [2, 2, 2, 2, 2, 2]))
    takes = 0
    while old.queued:
        batch = batcher.take(wait=False)
        takes += 1
        assert batch is not None
        assert any(seg.request is old for seg, _ in batch.parts)
    assert takes == 2  # (50, 50), then old's 2 with one of new's


def test_dropped_requests_leave_the_pool() -> None:
    batcher = MicroBatcher(max_batch_size=8, max_batch_tokens=100, max_queue=100)
    a, b = Request(2), Request(2)
    for req in (a, b):
        batcher.admit(req)
        batcher.add(segment(req, [3, 4]))
    assert batcher.drop(a) == 2
    assert batcher.queue_depth == 2
    batch = batcher.take(wait=False)
    assert batch is not None and {seg.request for seg, _ in batch.parts} == {b}
    assert not batcher.add(segment(a, [5]))  # late segments of a dropped request are ignored


def test_close_wakes_a_waiting_taker() -> None:
    batcher = MicroBatcher(max_batch_size=8, max_batch_tokens=100, max_queue=100)
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(batcher.take(wait=True)))
    thread.start()
    batcher.close()
    thread.join(30)
    assert result == [None]
    with pytest.raises(EmbedderClosedError):
        batcher.admit(Request(1))
