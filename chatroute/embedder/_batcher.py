"""The embedder's micro-batching queue: admission, length-planned token-budgeted batches, drops.

Pure Python and numpy (no model): requests are admitted (counted in texts against a bound),
their tokenised texts arrive as length-sorted segments, and the model workers take batches
with `take()`. A lone request goes at once; requests that arrive during a forward pass
accumulate and form the next batch, and a free worker may hold a small batch back for a
bounded time while more texts are on their way (`max_wait`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from chatroute.embedder.errors import EmbedderClosedError, EmbedderOverloadedError

__all__ = ["Batch", "MicroBatcher", "Request", "Segment"]

IntArray = npt.NDArray[np.int64]


# A solo pass of this many texts or fewer is short (about one text's time on a CPU), so
# callers that come back meanwhile wait little for it: it may run solo under load too.
SOLO_ALWAYS = 4
# Once this many texts wait during a solo pass, another worker starts one beside it anyway
# (the cores are shared for the rest of the solo pass): a burst is not held back.
SOLO_JOIN = 8


class Request:
    """One caller's texts as the batcher sees them; subclassed by the embedder."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queued = 0  # admitted texts not yet taken into a batch
        self.dead = False  # cancelled, failed or closed: no more work is done for it
        self.segments: list[Segment] = []  # its segments still in the pool
        self.came_idle = False  # admitted while no forward pass was computing


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
    """Rows for one forward pass: `parts` are (segment, row offsets in it), texts in that order.

    Padded (`width` 0): one text a row, each padded to `max_len`. Packed (`width` > 0):
    texts laid end to end in `rows` rows of `width` tokens, text k starting at flat position
    `starts[k]` (row x width + column); each text attends only to itself.
    """

    parts: list[tuple[Segment, IntArray]]
    size: int
    max_len: int
    width: int = 0
    starts: IntArray | None = None
    rows: int = 0
    solo: bool = False  # taken by the lead worker with nothing else running or queued
    computed: bool = False  # its forward pass is over (`MicroBatcher.computed`)

    @property
    def padded_tokens(self) -> int:
        """Token positions the forward pass computes: rows x row width."""
        return self.rows * self.width if self.width else self.size * self.max_len

    @property
    def lengths(self) -> IntArray:
        """Token length of each text, in batch order."""
        return np.concatenate([seg.lengths[offs] for seg, offs in self.parts])


class MicroBatcher:
    """Thread-safe queue that forms length-planned batches under a size cap and a token budget.

    Batch choice: a window of the oldest ready texts (up to `window` of them, in arrival
    order) is sorted by token length and cut into batches by `plan_batch`; the batch taken is
    the one holding the oldest text. Every batch thus serves the oldest request (no
    starvation) and groups texts of similar length (little padding). `pass_cost` is the fixed
    cost of one forward pass, in padded-token equivalents: small on a CPU (where cost follows
    padded tokens), large on a GPU (where each pass has a launch cost). With `pack_width`,
    a batch whose texts are all at most that many tokens long is packed: texts laid end to
    end in rows of `pack_width` tokens (`pack_rows`), so short texts of any lengths share a
    pass without padding each other.

    Holding back: see `take`; `max_wait` (seconds) bounds it, `workers` (the model
    threads that take batches) sets a worker's share of the texts in flight.

    Solo passes (`solo`): worker 0, the lead, takes every batch formed while no pass runs,
    and such a batch is marked `solo` when it holds every text admitted and either its
    requests all arrived while no pass was computing (low traffic) or it holds at most
    `SOLO_ALWAYS` texts. Under steady load callers come back while another pass runs, and
    a large solo pass there would hold them all back: passes then stay side by side. The
    other workers take batches only while a pass that is not solo runs, or once
    `SOLO_JOIN` texts wait beside a solo one. So an idle embedder's next pass always goes
    to the same thread, which may run it on all the cores (one OpenMP team in the
    process, not one per worker), and little shares the cores with a solo pass.
    """

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_batch_tokens: int,
        max_queue: int,
        pass_cost: int = 0,
        window: int | None = None,
        pack_width: int = 0,
        max_wait: float = 0.0,
        workers: int = 1,
        solo: bool = False,
        clock: Callable[[], float] = time.monotonic,
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
        if isinstance(pack_width, bool) or not isinstance(pack_width, int) or pack_width < 0:
            raise ValueError(f"pack_width must be a non-negative int, got {pack_width!r}")
        if pack_width > max_batch_tokens:
            raise ValueError(
                f"pack_width ({pack_width}) must be at most max_batch_tokens ({max_batch_tokens})"
            )
        self.pack_width = pack_width
        if (
            isinstance(max_wait, bool)
            or not isinstance(max_wait, (int, float))
            or not (0 <= max_wait < float("inf"))
        ):
            raise ValueError(f"max_wait must be a non-negative number of seconds, got {max_wait!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.max_wait = float(max_wait)
        self.workers = workers
        self._clock = clock
        self.solo = bool(solo)
        self._running = 0  # texts in forward passes not yet reported `finished`
        self._solo_running = False
        self._computing = 0  # passes taken whose forward pass is not over
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the workers (all of them without `solo`)
        self._lead_cond = threading.Condition(lock) if self.solo else self._cond
        self._pool: deque[Segment] = deque()
        self._ready = 0  # alive texts in the pool
        self._queued = 0  # admitted texts not yet taken (pool + still being tokenised)
        # The most texts seen in flight (running or queued) since a hold last ran out.
        self._peak = 0
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
            request.came_idle = self._computing == 0
            self._queued += request.size
            self._peak = max(self._peak, self._running + self._queued)

    def add(self, segment: Segment) -> bool:
        """Put a tokenised segment in the pool; False (dropped) when its request is dead."""
        with self._cond:
            request = segment.request
            if self._closed or request.dead:
                return False
            self._pool.append(segment)
            request.segments.append(segment)
            self._ready += segment.n_alive
            self._wake()
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
            self._lead_cond.notify_all()

    @property
    def running(self) -> int:
        """Texts in forward passes that have not been reported `finished`."""
        return self._running

    def finished(self, batch: Batch) -> None:
        """Report that `batch`'s forward pass is over (a worker waiting for company rechecks)."""
        with self._cond:
            self._running -= batch.size
            self._mark_computed(batch)
            if batch.solo:
                self._solo_running = False
            self._cond.notify_all()
            self._lead_cond.notify_all()

    def computed(self, batch: Batch) -> None:
        """Report that `batch`'s forward pass is over, before its answers go out: callers
        that come back from then on arrived at an idle embedder (`finished` implies it)."""
        with self._cond:
            self._mark_computed(batch)

    def _mark_computed(self, batch: Batch) -> None:
        if not batch.computed:
            batch.computed = True
            self._computing -= 1

    def end_solo(self) -> None:
        """The lead worker is gone: the others stop deferring to it."""
        with self._cond:
            self.solo = False
            self._solo_running = False
            self._cond.notify_all()
            self._lead_cond.notify_all()

    def _defers(self, worker: int) -> bool:
        """With `solo`, a worker other than the lead waits while no pass runs (the lead
        takes the next one) and while a solo pass runs (it has the cores), unless
        `SOLO_JOIN` texts are ready."""
        return (
            self.solo
            and worker != 0
            and (self._running == 0 or (self._solo_running and self._ready < SOLO_JOIN))
        )

    def _wake(self) -> None:
        """Texts became ready: wake the worker that may take them."""
        if self._lead_cond is not self._cond:
            self._lead_cond.notify()
        if not self._defers(1):
            self._cond.notify()

    def _should_wait(self) -> bool:
        """A free worker holds back while fewer texts are ready than its share of the texts
        in flight (in other workers' passes, ready, or still being tokenised), one
        `workers`-th: with nothing else in flight a ready text is always enough, and passes
        side by side stay about the same size instead of a large one beside a few texts.

        It holds back only for texts that may still come: callers whose answers went out
        come back with their next texts, so the most texts seen in flight since a hold last
        ran out is what to expect. Once that many are running or ready, nothing is on its
        way, and waiting would only idle the worker (with 64 one-text callers, a split of
        33 against 31 texts, or 60 against 4, would otherwise cost the smaller side the
        whole bound on every pass)."""
        if self._running + self._ready >= self._peak:
            return False
        share = (self._running + self._queued) // self.workers
        return self._ready < min(share, self.max_batch_size)

    def take(self, *, wait: bool, worker: int = 0) -> Batch | None:
        """The next batch for model thread `worker`. With `wait`, block until one is ready
        (None once closed); without, return None at once when nothing is ready (or, with
        `solo`, when this worker defers to the lead).

        With `wait` and `max_wait` > 0, a free worker holds the batch back while fewer
        texts are ready than its share of those in flight and more may still come
        (`_should_wait`): until enough are ready, other passes finish, or `max_wait` seconds
        have passed since it found texts ready. A lone request is never held; the oldest
        ready text is in every batch, so it is held at most `max_wait` for each batch.
        """
        cond = self._lead_cond if worker == 0 else self._cond
        with cond:
            deadline: float | None = None
            while True:
                while not self._ready or self._defers(worker):
                    if self._closed or not wait:
                        return None
                    cond.wait()
                if self._closed:
                    return None
                if not wait or self.max_wait <= 0 or not self._should_wait():
                    break
                now = self._clock()
                if deadline is None:
                    deadline = now + self.max_wait
                if now >= deadline:
                    # What it waited for did not come: expect what is in flight now.
                    self._peak = self._running + self._queued
                    break
                cond.wait(deadline - now)
                if self._defers(worker):  # a solo pass began meanwhile
                    deadline = None
            idle = self._running == 0
            batch = self._form_batch()
            if (
                self.solo
                and worker == 0
                and idle
                and not self._queued
                and (
                    batch.size <= SOLO_ALWAYS
                    or all(seg.request.came_idle for seg, _ in batch.parts)
                )
            ):
                batch.solo = self._solo_running = True
            self._running += batch.size
            self._computing += 1
            if self._ready:  # more than one batch was ready: wake another worker for it
                self._cond.notify()
                if worker != 0 and self._lead_cond is not self._cond:
                    self._lead_cond.notify()
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
        head = int(np.flatnonzero(order == 0)[0])  # the oldest ready text
        lo, hi = plan_batch(
            lengths[order],
            head=head,
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            pass_cost=self.pass_cost,
            pack_width=self.pack_width,
        )
        chosen = order[lo:hi]
        max_len = max(int(lengths[chosen].max()), 1)
        starts: IntArray | None = None
        rows = width = 0
        if 2 * max_len <= self.pack_width:
            packed = self._pack_within_budget(lengths, chosen, head - lo)
            padded = len(chosen) * max_len
            if padded > self.max_batch_tokens or packed[2] * packed[3] < padded:
                chosen, starts, rows, width = packed
                max_len = max(int(lengths[chosen].max()), 1)

        # Group the chosen texts by segment, in pool order, offsets ascending.
        seg_arr = np.array(seg_of, dtype=np.int64)[chosen]
        off_arr = np.array(off_of, dtype=np.int64)[chosen]
        by_seg = np.lexsort((off_arr, seg_arr))
        seg_arr, off_arr = seg_arr[by_seg], off_arr[by_seg]
        if starts is not None:
            starts = starts[by_seg]
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
        return Batch(parts=parts, size=size, max_len=max_len, width=width, starts=starts, rows=rows)

    def _pack_within_budget(
        self, lengths: IntArray, chosen: IntArray, head: int
    ) -> tuple[IntArray, IntArray, int, int]:
        """Pack `chosen` (window indices, by length ascending; `head` the position of the
        oldest text in it) into rows: (chosen, starts, rows, row width). The planner counted
        whole rows of `pack_width`; when the packed rows come out over the token budget, the
        longest texts other than the oldest are left for a later pass."""
        while True:
            starts, rows, width = pack_rows(lengths[chosen], self.pack_width)
            if rows * width <= self.max_batch_tokens or len(chosen) == 1:
                return chosen, starts, rows, width
            drop = len(chosen) - 1 if head != len(chosen) - 1 else len(chosen) - 2
            chosen = np.delete(chosen, drop)
            head -= drop < head


def plan_batch(
    sorted_lengths: IntArray,
    *,
    head: int,
    max_batch_size: int,
    max_batch_tokens: int,
    pass_cost: int,
    pack_width: int = 0,
) -> tuple[int, int]:
    """Rows [lo, hi) of `sorted_lengths` (token lengths, ascending) to run as the next batch.

    The window is split into contiguous batches minimising the total cost
    sum(pass_cost + computed token positions), each within `max_batch_size` texts and
    `max_batch_tokens` token positions; the batch returned is the one holding row `head`.
    A padded batch computes texts x longest; a batch whose longest text is at most half of
    `pack_width` (when > 0) may be packed instead, and is counted as its tokens spread
    evenly over as many rows of `pack_width` as they need, when that is fewer. The split
    runs over distinct lengths (equal lengths always share a batch unless one length alone
    overflows the limits, then it is cut into full batches), so it costs O(distinct
    lengths squared), not O(rows squared).
    """
    values, counts = np.unique(sorted_lengths, return_counts=True)
    lens = np.maximum(values, 1)
    width = max(pack_width, 1)
    packs = 2 * lens <= pack_width  # batches of texts up to half a row may be packed
    # Texts of one length per pass: padded, the budget over the length; packed, whole rows.
    padded_room = np.maximum(1, np.minimum(max_batch_size, max_batch_tokens // lens))
    packed_room = max(max_batch_tokens // width, 1) * (width // lens)
    room = np.where(
        packs, np.maximum(padded_room, np.minimum(max_batch_size, packed_room)), padded_room
    )
    prefix = np.concatenate(([0], np.cumsum(counts)))
    tokens = np.concatenate(([0], np.cumsum(counts * lens)))
    n_values = len(values)
    best = np.zeros(n_values + 1, dtype=np.float64)
    first = np.zeros(n_values + 1, dtype=np.int64)  # first length index of the batch ending here
    for b in range(n_values):
        rows = prefix[b + 1] - prefix[: b + 1]  # texts of a batch spanning lengths a..b
        positions = rows * lens[b]  # padded
        over = rows > padded_room[b]
        if packs[b]:
            # Packed: the tokens spread evenly over as many rows as they need.
            spans = tokens[b + 1] - tokens[: b + 1]
            n_rows = -(-spans // width)
            slots = n_rows * -(-spans // n_rows)
            positions = np.where(over, slots, np.minimum(positions, slots))
            over = (rows > max_batch_size) | (over & (slots > max_batch_tokens))
        cost = best[: b + 1] + pass_cost + positions
        cost[over] = np.inf
        # One length alone may need several full passes.
        alone_positions = counts[b] * lens[b]
        if packs[b] and room[b] > padded_room[b]:
            alone_positions = -(-counts[b] // (width // lens[b])) * width
        alone = best[b] + -(-counts[b] // room[b]) * pass_cost + alone_positions
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


def pack_rows(lengths: IntArray, width: int) -> tuple[IntArray, int, int]:
    """Lay texts of `lengths` end to end in rows of about `width` tokens, computing as few
    token positions (rows x row width) as two packings find: first fit by decreasing
    length into rows of `width` (tight when many short texts fill the gaps), and the rows
    that needs made even, each text (longest first) into the emptiest row (tight when few
    texts leave the last row half empty). Returns each text's flat start (row x row width
    + column), the rows, and the row width (the fullest row's tokens: for the second
    packing a little over `width` at most by the longest text)."""
    sizes = np.maximum(lengths, 1)
    order = np.argsort(-sizes, kind="stable").tolist()
    size_list = sizes.tolist()
    # First fit decreasing into rows of `width` (a text longer than that gets its own row).
    fills: list[int] = []
    ffd_row = [0] * len(size_list)
    for i in order:
        size = size_list[i]
        row = next((r for r, fill in enumerate(fills) if fill + size <= width), len(fills))
        if row == len(fills):
            fills.append(0)
        ffd_row[i] = row
        fills[row] += size
    best = (len(fills) * max(fills), ffd_row, len(fills))
    # Even rows: as many as first fit used, and as many as the tokens need at `width`.
    for rows in sorted({len(fills), max(1, -(-sum(size_list) // width))}):
        heap = [(0, row) for row in range(rows)]  # (tokens so far, row): a valid heap
        even_row = [0] * len(size_list)
        for i in order:
            fill, row = heap[0]
            even_row[i] = row
            heapq.heapreplace(heap, (fill + size_list[i], row))
        positions = rows * max(fill for fill, _ in heap)
        if positions < best[0]:
            best = (positions, even_row, rows)
    _, row_of, rows = best
    # Columns: each row's texts end to end, in the order they were placed.
    column = [0] * rows
    cols = [0] * len(size_list)
    for i in order:
        cols[i] = column[row_of[i]]
        column[row_of[i]] += size_list[i]
    row_width = max(column)
    starts = np.array(row_of, dtype=np.int64) * row_width + np.array(cols, dtype=np.int64)
    return starts, rows, row_width
