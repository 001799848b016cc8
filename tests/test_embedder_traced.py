"""The embedder's traced packed pass: used on a CPU when it equals the eager one, else not."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from chatroute.embedder import SentenceTransformerEmbedder
from chatroute.embedder._model import ModelRunner
from chatroute.embedder._traced import PackedPass, trace_packed

TEXTS = [
    "what is my checking balance",
    "book a table for two at seven tonight",
    "how do I say thank you in italian",
    "",
    "ÜMLAUTS and accents: école, naïve",
    "set an alarm for 6 am tomorrow and remind me to call mom about the weekend trip plans",
    "x",
    "tell me a joke",
]


def eager_pass(runner: ModelRunner) -> PackedPass:
    return runner.packed_pass()


@pytest.fixture
def probe_state(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    """The shared runner, its pass restored after a test that probes again."""
    monkeypatch.setattr(runner, "_pass", runner._pass)
    return runner


def test_the_default_model_runs_traced_passes_equal_to_the_eager_module(
    runner: ModelRunner,
) -> None:
    assert runner.packs and runner.traced
    assert not isinstance(runner._pass, PackedPass)  # the trace, not the module
    eager = eager_pass(runner)
    # Other row counts and widths than the probes', texts of every kind.
    for texts, width in ((TEXTS, 64), (TEXTS * 5, 64), (TEXTS[:3], 16), (TEXTS * 3, 40)):
        inputs = runner._packed_inputs(runner.packed_batch(texts, width))
        with torch.inference_mode():
            got, want = runner._forward_packed(runner.packed_batch(texts, width)), eager(*inputs)
        assert got.shape == (len(texts), runner.dimension)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


async def test_generate_through_traced_passes_equals_sentence_transformers_encode(
    make: Callable[..., SentenceTransformerEmbedder], runner: ModelRunner
) -> None:
    emb = make()
    assert emb._runner.traced
    texts = [f"{t} {n}" for n in range(12) for t in TEXTS]
    got = await emb.generate(texts)
    want = runner._st.encode(texts, convert_to_numpy=True, normalize_embeddings=True)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_trace_that_differs_is_refused_and_passes_stay_eager(
    probe_state: ModelRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = probe_state

    def wrong_trace(module: torch.nn.Module, inputs: Any, **_: Any) -> Callable[..., Any]:
        return lambda *args: module(*args) + 1e-3  # off by more than the tolerance

    monkeypatch.setattr(torch.jit, "trace", wrong_trace)
    with caplog.at_level(logging.INFO, logger="chatroute.embedder"):
        assert runner._setup_packing()  # packing itself still holds
    assert not runner.traced and isinstance(runner._pass, PackedPass)
    assert "the traced forward pass differs; passes stay eager" in caplog.text
    batch = runner.packed_batch(TEXTS, 64)
    with torch.inference_mode():
        got = runner._forward_packed(batch)
        want = eager_pass(runner)(*runner._packed_inputs(batch))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_model_the_tracer_cannot_follow_keeps_the_eager_pass(
    probe_state: ModelRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runner = probe_state

    def refuse(*_: Any, **__: Any) -> Any:
        raise RuntimeError("cannot trace this")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    with caplog.at_level(logging.INFO, logger="chatroute.embedder"):
        assert runner._setup_packing()
    assert not runner.traced and isinstance(runner._pass, PackedPass)
    assert "could not be traced (RuntimeError); passes stay eager" in caplog.text


def test_trace_packed_keeps_the_trace_only_when_every_probe_agrees(runner: ModelRunner) -> None:
    eager = eager_pass(runner)
    probes = [runner._packed_inputs(runner.packed_batch(TEXTS[:k], 64)) for k in (3, 8)]
    traced = trace_packed(eager, probes, tolerance=1e-5)
    assert traced is not None
    batch = runner._packed_inputs(runner.packed_batch(TEXTS * 4, 24))
    with torch.inference_mode():
        torch.testing.assert_close(traced(*batch), eager(*batch), atol=1e-6, rtol=0)


def test_two_model_threads_share_the_trace(
    make: Callable[..., SentenceTransformerEmbedder], runner: ModelRunner
) -> None:
    emb = make(workers=2)
    texts = [f"{t} {n}" for n in range(16) for t in TEXTS]
    want = runner.embed_direct(texts)
    results: list[Any] = []
    barrier = threading.Barrier(3)

    def call(part: list[str]) -> None:
        barrier.wait()
        results.append((part, emb.embed_sync(part)))

    threads = [threading.Thread(target=call, args=(texts[i::3],)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert emb.batches_run >= 2
    for part, rows in results:
        expected = want[[texts.index(t) for t in part]]
        np.testing.assert_allclose(rows, expected, atol=1e-5)
