"""How many intra-op threads the calling thread's torch operators use, set per thread."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

__all__ = ["one_thread", "team_size_setter", "use_threads"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


def use_threads(count: int) -> None:
    """Run the calling thread's torch operators on `count` intra-op threads.

    `torch.set_num_threads` sets the calling thread's OpenMP team size, and also the size
    that threads starting later take on their first operator; the second is put back
    (from a short-lived thread, whose own setting dies with it), so the process default
    the caller chose stays as it was.
    """
    with _LOCK:
        before = torch.get_num_threads()
        if before == count:
            return
        torch.set_num_threads(count)
        restore = threading.Thread(target=torch.set_num_threads, args=(before,))
        restore.start()
        restore.join()


@functools.cache
def team_size_setter() -> Callable[[int], None] | None:
    """`omp_set_num_threads` of the OpenMP runtime torch runs on: the calling thread's team
    size alone, in a microsecond, where `torch.set_num_threads` also changes process-wide
    settings (the size later threads start with, MKL's, a cleared oneDNN cache). None when
    torch's operators do not run on an OpenMP runtime found beside it."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    folder = Path(torch.__file__).parent / "lib"
    for pattern in ("libgomp*.so*", "libiomp5*.so*", "libomp*.so*", "libomp*.dylib"):
        for path in sorted(folder.glob(pattern)):
            try:
                fn = ctypes.CDLL(str(path)).omp_set_num_threads
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_int]
            fn.restype = None
            return fn  # type: ignore[no-any-return]
    logger.debug("embedder: no OpenMP runtime found beside torch in %s", folder)
    return None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block's torch operators on the calling thread alone, forming no OpenMP team
    there (a team that outlives the block would slow every other team in the process:
    the runtime stops spinning for work once its threads outnumber the cores)."""
    setter = team_size_setter()
    if setter is None:
        yield
        return
    before = torch.get_num_threads()
    setter(1)
    try:
        yield
    finally:
        setter(before)
