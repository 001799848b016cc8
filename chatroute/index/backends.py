"""Search backends for the profile index: FAISS on the CPU, FAISS on a GPU, exact torch matmul."""

from __future__ import annotations

from typing import Any, Protocol

import faiss
import numpy as np
import numpy.typing as npt

__all__ = ["FaissCpuBackend", "FaissGpuBackend", "SearchBackend", "TorchBackend", "faiss_has_gpu"]

Float32Array = npt.NDArray[np.float32]
Int64Array = npt.NDArray[np.int64]

# Batches of fewer query rows are searched on one OpenMP thread: FAISS's multi-threaded
# scan of a few queries gains little and, on a machine whose cores are also busy (the
# embedder, the event loop), waits on preempted OpenMP workers: measured on 2 cores, one
# query against 100,000 profiles took 52 ms on 2 threads and 14 ms on one.
_SINGLE_THREAD_ROWS = 64
# FAISS GPU selects at most this many neighbours per query (GPU_MAX_SELECTION_K).
_FAISS_GPU_MAX_K = 2048
# The torch backend scores at most this many (query, profile) pairs per matmul.
_TORCH_CHUNK_ELEMENTS = 1 << 25


class SearchBackend(Protocol):
    """Returns a top-k set (in any order among equal scores) for each query row."""

    name: str

    def topk(self, queries: Any, k: int) -> tuple[Float32Array, Int64Array]:
        """Scores and profile ids of a top-`k` set per row of `queries` (k <= bank size)."""
        ...


def faiss_has_gpu() -> bool:
    """Whether the installed faiss build can search on a CUDA device."""
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _host_float32(queries: Any) -> Float32Array:
    if type(queries).__module__.split(".")[0] == "torch":
        queries = queries.detach().float().cpu().numpy()
    return np.ascontiguousarray(queries, dtype=np.float32)


class FaissCpuBackend:
    """An `IndexFlatIP` on the CPU: exact inner products over every profile."""

    name = "faiss"

    def __init__(self, vectors: Float32Array) -> None:
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def topk(self, queries: Any, k: int) -> tuple[Float32Array, Int64Array]:
        rows = _host_float32(queries)
        if rows.shape[0] < _SINGLE_THREAD_ROWS:
            # The OpenMP thread count belongs to the calling thread and is shared with
            # torch there: put it back after the search.
            previous = faiss.omp_get_max_threads()
            faiss.omp_set_num_threads(1)
            try:
                scores, ids = self.index.search(rows, k)
            finally:
                faiss.omp_set_num_threads(previous)
        else:
            scores, ids = self.index.search(rows, k)
        return scores, ids.astype(np.int64, copy=False)


class FaissGpuBackend:
    """The same `IndexFlatIP` copied to a CUDA device; k above FAISS's GPU cap uses the CPU copy."""

    name = "faiss-gpu"

    def __init__(self, vectors: Float32Array, device_id: int) -> None:
        self.cpu = FaissCpuBackend(vectors)
        self.resources = faiss.StandardGpuResources()
        self.index = faiss.index_cpu_to_gpu(self.resources, device_id, self.cpu.index)

    def topk(self, queries: Any, k: int) -> tuple[Float32Array, Int64Array]:
        if k > _FAISS_GPU_MAX_K:
            return self.cpu.topk(queries, k)
        scores, ids = self.index.search(_host_float32(queries), k)
        return scores, ids.astype(np.int64, copy=False)


class TorchBackend:
    """Exact top-k by a float32 matmul on a torch device (any device, the CPU included)."""

    name = "torch"

    def __init__(self, vectors: Float32Array, device: str) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        host = np.array(vectors, dtype=np.float32, copy=True)
        self.matrix = torch.from_numpy(host).to(self.device)

    def topk(self, queries: Any, k: int) -> tuple[Float32Array, Int64Array]:
        torch = self._torch
        if isinstance(queries, torch.Tensor):
            q = queries.detach().to(device=self.device, dtype=torch.float32)
        else:
            q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)
        n = self.matrix.shape[0]
        rows = max(1, _TORCH_CHUNK_ELEMENTS // max(n, 1))
        score_parts = []
        id_parts = []
        with torch.inference_mode():
            for start in range(0, q.shape[0], rows):
                sims = q[start : start + rows] @ self.matrix.T
                values, indices = torch.topk(sims, k, dim=1, largest=True, sorted=True)
                score_parts.append(values)
                id_parts.append(indices)
            if score_parts:
                scores = torch.cat(score_parts).cpu().numpy()
                ids = torch.cat(id_parts).cpu().numpy().astype(np.int64, copy=False)
            else:
                scores = np.zeros((0, k), dtype=np.float32)
                ids = np.zeros((0, k), dtype=np.int64)
        return scores, ids
