"""The embedder's micro-batching queue: admission, length-sorted token-budgeted batches, drops.

Pure Python and numpy (no model): requests are admitted (counted in texts against a bound),
their tokenised texts arrive as length-sorted segments, and the model worker takes batches
with `take()`. There is no waiting timer: `take()` hands out whatever is ready the moment it
is called, so a lone request goes at once while requests that arrive during a forward pass
accumulate and form the next batch.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from chatroute.embedder.errors import EmbedderClosedError, EmbedderOverloadedError

__all__ = ["Batch", "MicroBatcher", "Request", "Segment"]

IntArray = npt.NDArray[np.int64]


class Request:
    """One caller's texts as the batcher sees them; subclassed by the embedder."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queued = 0  # admitted texts not yet taken into a batch
        self.dead = False  # cancelled, failed or closed: no more work is done for it
        self.segments: list[Segment] = []  # its segments still in the pool


@dataclass(eq=False)
class Segment:
    """Tokenised texts of one request, sorted by token length (shortest first).

    `positions[r]` is the index in the request of row r; `ids` (rows padded with the pad id)
    holds token ids when the model's tokeniser was run, `texts` the raw texts otherwise.
    """

    request: Request
    positions: IntArray
    lengths: IntArray
    ids: IntArray | None = None
    texts: list[str] | None = None
    alive: npt.NDArray[np.bool_] = field(init=False)
    n_alive: int = field(init=False)
    length_list: list[int] = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.positions)
        if len(self.lengths) != n:
            raise ValueError("a segment needs one length per position")
        self.alive = np.ones(n, dtype=np.bool_)
        self.n_alive = n
        self.length_list = self.lengths.tolist()


@dataclass(eq=False)
class Batch:
    """Rows for one forward pass: `parts` are (segment, row offsets in it), rows in that order."""

    parts: list[tuple[Segment, IntArray]]
    size: int
    max_len: int

    @property
    def padded_tokens(self) -> int:
        """Token positions the forward pass computes: rows x longest row."""
        return self.size * self.max_len

    @property
    def lengths(self) -> IntArray:
        """Token length of each row, in row order."""
        return np.concatenate([seg.lengths[offs] for seg, offs in self.parts])


class MicroBatcher:
    """Thread-safe queue that forms length-sorted batches under a size cap and a token budget.

    Batch choice: a window of the oldest ready texts (up to `window` of them, in arrival
    order) is sorted by token length and cut into batches by `plan_batch`; the batch taken is
    the one holding the oldest text. Every batch thus serves the oldest request (no
    starvation) and groups texts of similar length (little padding). `pass_cost` is the fixed
    cost of one forward pass, in padded-token equivalents: small on a CPU (where cost follows
    padded tokens), large on a GPU (where each pass has a launch cost).
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_queue: int,
        pass_cost: int = 0,
        window: int | None = None,
    ) -> None:
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_batch_tokens", max_batch_tokens),
            ("max_queue", max_queue),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        if isinstance(pass_cost, bool) or not isinstance(pass_cost, int) or pass_cost < 0:
            raise ValueError(f"pass_cost must be a non-negative int, got {pass_cost!r}")
        self.pass_cost = pass_cost
        self.window = window if window is not None else 4 * max_batch_size
        if self.window < max_batch_size:
            raise ValueError("window must be at least max_batch_size")
        self._cond = threading.Condition()
        self._pool: deque[Segment] = deque()
        self._ready = 0  # alive texts in the pool
        self._queued = 0  # admitted texts not yet taken (pool + still being tokenised)
        self._closed = False

    @property
    def queue_depth(self) -> int:
        """Texts admitted and not yet in a forward pass."""
        return self._queued

    @property
    def ready(self) -> int:
        """Texts tokenised and waiting in the pool (a subset of `queue_depth`)."""
        return self._ready

    @property
    def closed(self) -> bool:
        return self._closed

    def admit(self, request: Request) -> None:
        """Count `request` against the queue bound, or refuse it.

        A request that alone exceeds `max_queue` is admitted only into an empty queue, so
        bulk offline calls still work on an idle embedder.
        """
        with self._cond:
            if self._closed:
                raise EmbedderClosedError("the embedder is closed")
            if self._queued and self._queued + request.size > self.max_queue:
                raise EmbedderOverloadedError(
                    f"embedder overloaded: {self._queued} texts are queued and this request "
                    f"adds {request.size}, over the bound of {self.max_queue} (max_queue); "
                    "retry later"
                )
            request.queued = request.size
            self._queued += request.size

    def add(self, segment: Segment) -> bool:
        """Put a tokenised segment in the pool; False (dropped) when its request is dead."""
        with self._cond:
            request = segment.request
            if self._closed or request.dead:
                return False
            self._pool.append(segment)
            request.segments.append(segment)
            self._ready += segment.n_alive
            self._cond.notify()
            return True

    def drop(self, request: Request) -> int:
        """Mark `request` dead and remove its queued texts; returns how many were dropped."""
        with self._cond:
            request.dead = True
            dropped = request.queued
            for seg in request.segments:
                self._ready -= seg.n_alive
                seg.n_alive = 0
                seg.alive[:] = False
            request.segments.clear()
            self._queued -= dropped
            request.queued = 0
            if dropped:
                self._pool = deque(s for s in self._pool if s.n_alive)
            return dropped

    def close(self) -> None:
        """Refuse new work, forget queued work and wake the worker (its `take` returns None)."""
        with self._cond:
            self._closed = True
            for seg in self._pool:
                seg.request.segments.clear()
            self._pool.clear()
            self._ready = 0
            self._queued = 0
            self._cond.notify_all()

    def take(self, *, wait: bool) -> Batch | None:
        """The next batch. With `wait`, block until one is ready (None once closed);
        without, return None at once when nothing is ready. Never waits for more work."""
        with self._cond:
            while not self._ready:
                if self._closed or not wait:
                    return None
                self._cond.wait()
            if self._closed:
                return None
            batch = self._form_batch()
            if self._ready:  # more than one batch was ready: wake another worker for it
                self._cond.notify()
            return batch

    def _form_batch(self) -> Batch:
        # The window: the oldest ready texts, in arrival order (plain lists: many callers
        # send one text each, and per-segment numpy calls would dominate).
        lens: list[int] = []
        seg_of: list[int] = []
        off_of: list[int] = []
        segs: list[Segment] = []
        for seg in self._pool:
            if not seg.n_alive:
                continue
            room = self.window - len(lens)
            if seg.n_alive == len(seg.alive):
                offs: list[int] = list(range(min(seg.n_alive, room)))
                lens.extend(seg.length_list[: len(offs)])
            else:
                offs = np.flatnonzero(seg.alive)[:room].tolist()
                lens.extend(seg.length_list[i] for i in offs)
            off_of.extend(offs)
            seg_of.extend([len(segs)] * len(offs))
            segs.append(seg)
            if len(lens) >= self.window:
                break
        lengths = np.array(lens, dtype=np.int64)

        order = np.argsort(lengths, kind="stable")
        lo, hi = plan_batch(
            lengths[order],
            head=int(np.flatnonzero(order == 0)[0]),  # the oldest ready text
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            pass_cost=self.pass_cost,
        )
        chosen = order[lo:hi]
        max_len = max(int(lengths[chosen].max()), 1)

        # Group the chosen rows by segment, in pool order, offsets ascending.
        seg_arr = np.array(seg_of, dtype=np.int64)[chosen]
        off_arr = np.array(off_of, dtype=np.int64)[chosen]
        by_seg = np.lexsort((off_arr, seg_arr))
        seg_arr, off_arr = seg_arr[by_seg], off_arr[by_seg]
        bounds = [0, *(np.flatnonzero(np.diff(seg_arr)) + 1).tolist(), len(seg_arr)]
        parts: list[tuple[Segment, IntArray]] = []
        for lo_, hi_ in itertools.pairwise(bounds):
            seg = segs[int(seg_arr[lo_])]
            offs_arr = off_arr[lo_:hi_]
            seg.alive[offs_arr] = False
            seg.n_alive -= hi_ - lo_
            seg.request.queued -= hi_ - lo_
            if not seg.n_alive:
                seg.request.segments.remove(seg)
            parts.append((seg, offs_arr))
        size = len(chosen)
        self._ready -= size
        self._queued -= size
        self._pool = deque(s for s in self._pool if s.n_alive)
        return Batch(parts=parts, size=size, max_len=max_len)


def plan_batch(
    sorted_lengths: IntArray,
    *,
    head: int,
    max_batch_size: int,
    max_batch_tokens: int,
    pass_cost: int,
) -> tuple[int, int]:
    """Rows [lo, hi) of `sorted_lengths` (token lengths, ascending) to run as the next batch.

    The window is split into contiguous batches minimising the total cost
    sum(pass_cost + rows x longest), each within `max_batch_size` rows and
    `max_batch_tokens` padded tokens; the batch returned is the one holding row `head`.
    The split runs over distinct lengths (equal lengths always share a batch unless one
    length alone overflows the limits, then it is cut into full batches), so it costs
    O(distinct lengths squared), not O(rows squared).
    """
    values, counts = np.unique(sorted_lengths, return_counts=True)
    lens = np.maximum(values, 1)
    room = np.maximum(1, np.minimum(max_batch_size, max_batch_tokens // lens))  # rows per pass
    prefix = np.concatenate(([0], np.cumsum(counts)))
    n_values = len(values)
    best = np.zeros(n_values + 1, dtype=np.float64)
    first = np.zeros(n_values + 1, dtype=np.int64)  # first length index of the batch ending here
    for b in range(n_values):
        rows = prefix[b + 1] - prefix[: b + 1]  # rows of a batch spanning lengths a..b
        cost = best[: b + 1] + pass_cost + rows * lens[b]
        cost[rows > room[b]] = np.inf
        # One length alone may need several full passes.
        alone = best[b] + -(-counts[b] // room[b]) * pass_cost + counts[b] * lens[b]
        a = int(np.argmin(cost))
        if cost[a] <= alone:
            best[b + 1], first[b + 1] = cost[a], a
        else:
            best[b + 1], first[b + 1] = alone, b
    # Walk the plan back to the batch holding `head`.
    target = int(np.searchsorted(values, sorted_lengths[head]))
    end = n_values
    while True:
        a = int(first[end])
        if a <= target:
            break
        end = a
    lo, hi = int(prefix[a]), int(prefix[end])
    if hi - lo > room[end - 1]:  # one length cut into several passes: take one, from head on
        lo = max(lo, min(head, hi - int(room[end - 1])))
        hi = lo + int(room[end - 1])
    return lo, hi
