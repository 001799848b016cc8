"""ProfileIndex: exact ranking with ties, backend equality, persistence and incremental rebuild."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from semantic_doubles import FINGERPRINT, FakeEmbeddingGenerator

from chatroute.chat import EmbeddingFingerprint
from chatroute.index import (
    FingerprintMismatchError,
    IndexFormatError,
    InvalidEmbeddingError,
    ProfileIndex,
    as_embedding_matrix,
    l2_normalize_rows,
)


def reference_topk(bank: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: float64 cosine scores, stable sort by (-score, id)."""
    b = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    scores = q.astype(np.float64) @ b.astype(np.float64).T
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, ids, axis=1), ids


def tie_heavy_bank() -> tuple[np.ndarray, np.ndarray]:
    """300 profiles in 3-d with exact float32 scores and large tie groups."""
    rows = [[1, 0, 0]] * 3 + [[0.6, 0.8, 0]] * 150 + [[0, 1, 0]] * 100 + [[0.6, 0, 0.8]] * 47
    bank = np.asarray(rows, dtype=np.float32)
    queries = np.asarray([[1, 0, 0], [0, 1, 0], [0, 0, 1], [3, 4, 0]], dtype=np.float32)
    return bank, queries


# -- ranking ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_index_ties_go_to_lower_profile_id(backend: str) -> None:
    bank = np.asarray([[0, 1], [1, 0], [1, 0], [1, 0], [0.8, 0.6]], dtype=np.float32)
    index = ProfileIndex(bank, backend=backend)  # type: ignore[arg-type]
    scores, ids = index.search(np.asarray([[1, 0]], dtype=np.float32), 1)
    assert ids.tolist() == [[1]] and scores.tolist() == [[1.0]]
    scores, ids = index.search(np.asarray([[1, 0]], dtype=np.float32), 2)
    assert ids.tolist() == [[1, 2]]
    scores, ids = index.search(np.asarray([[1, 0]], dtype=np.float32), 10)
    assert ids.tolist() == [[1, 2, 3, 4, 0]]
    assert scores.shape == (1, 5)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 40, 152, 153, 154, 300])
def test_index_exact_at_top_k_boundary_inside_large_tie_groups(backend: str, k: int) -> None:
    # Tie groups of 150 and 100 are far wider than the fetch margin, forcing re-searches.
    bank, queries = tie_heavy_bank()
    index = ProfileIndex(bank, backend=backend)  # type: ignore[arg-type]
    scores, ids = index.search(queries, k)
    ref_scores, ref_ids = reference_topk(bank, queries, k)
    assert ids.tolist() == ref_ids.tolist()
    np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["faiss", "torch"])
def test_index_random_bank_matches_brute_force(backend: str) -> None:
    rng = np.random.default_rng(7)
    bank = rng.standard_normal((2000, 24)).astype(np.float32)
    queries = rng.standard_normal((64, 24)).astype(np.float32)
    index = ProfileIndex(bank, backend=backend)  # type: ignore[arg-type]
    scores, ids = index.search(queries, 7)
    ref_scores, ref_ids = reference_topk(bank, queries, 7)
    assert ids.tolist() == ref_ids.tolist()
    np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=1e-5)
    assert scores.dtype == np.float32 and ids.dtype == np.int64


@pytest.mark.parametrize("rows", [1, 63, 64, 200])
def test_faiss_search_leaves_the_callers_thread_count_alone(rows: int) -> None:
    """Small batches search on one OpenMP thread; the caller's count (which torch shares in
    that thread) is the same afterwards, and results match brute force either way."""
    import faiss
    import torch

    rng = np.random.default_rng(rows)
    bank = rng.standard_normal((500, 16)).astype(np.float32)
    queries = rng.standard_normal((rows, 16)).astype(np.float32)
    index = ProfileIndex(bank, backend="faiss")
    before = (faiss.omp_get_max_threads(), torch.get_num_threads())
    _, ids = index.search(queries, 3)
    assert (faiss.omp_get_max_threads(), torch.get_num_threads()) == before
    assert ids.tolist() == reference_topk(bank, queries, 3)[1].tolist()


@pytest.mark.parametrize("k", [1, 5, 64])
def test_index_torch_matmul_path_equals_faiss(k: int) -> None:
    rng = np.random.default_rng(11)
    bank = rng.standard_normal((1500, 16)).astype(np.float32)
    bank[500:520] = bank[3]  # a tie group
    queries = np.concatenate([rng.standard_normal((40, 16)), bank[3:4] * 2]).astype(np.float32)
    faiss_index = ProfileIndex(bank, backend="faiss")
    torch_index = ProfileIndex(bank, backend="torch", device="cpu")
    assert (faiss_index.backend, torch_index.backend) == ("faiss", "torch")
    f_scores, f_ids = faiss_index.search(queries, k)
    t_scores, t_ids = torch_index.search(queries, k)
    assert f_ids.tolist() == t_ids.tolist()
    np.testing.assert_allclose(f_scores, t_scores, rtol=0, atol=1e-5)
    torch = pytest.importorskip("torch")
    _, tensor_ids = torch_index.search(torch.from_numpy(queries), k)
    assert tensor_ids.tolist() == f_ids.tolist()
    _, h_ids = faiss_index.search(torch.from_numpy(queries), k)
    assert h_ids.tolist() == f_ids.tolist()


def test_index_tie_heavy_torch_equals_faiss() -> None:
    bank, queries = tie_heavy_bank()
    for k in (1, 3, 10, 160):
        f = ProfileIndex(bank, backend="faiss").search(queries, k)
        t = ProfileIndex(bank, backend="torch").search(queries, k)
        assert f[1].tolist() == t[1].tolist()
        assert f[0].tolist() == t[0].tolist()


def test_index_normalises_rows_and_queries() -> None:
    index = ProfileIndex(np.asarray([[3, 4], [0, 5]], dtype=np.float32))
    np.testing.assert_allclose(index.vectors, [[0.6, 0.8], [0, 1]], atol=1e-7)
    assert not index.vectors.flags.writeable
    unit = np.asarray([[1, 0], [0, 1]], dtype=np.float32)
    kept = ProfileIndex(unit)
    unit[0, 0] = 5
    assert kept.vectors.tolist() == [[1, 0], [0, 1]]
    scores, ids = index.search(np.asarray([[0, 10]], dtype=np.float32), 2)
    assert ids.tolist() == [[1, 0]]
    np.testing.assert_allclose(scores, [[1.0, 0.8]], atol=1e-6)
    # Pre-normalised queries are used as they are: a zero row scores 0 everywhere.
    scores, _ = index.search(np.zeros((1, 2), dtype=np.float32), 2, normalized=True)
    assert scores.tolist() == [[0.0, 0.0]]


def test_index_search_argument_checks() -> None:
    index = ProfileIndex(np.eye(3, dtype=np.float32))
    for bad_k in (True, 1.5, "2"):
        with pytest.raises(TypeError):
            index.search(np.eye(3, dtype=np.float32), bad_k)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        index.search(np.eye(3, dtype=np.float32), 0)
    with pytest.raises(ValueError):
        index.search(np.ones((2, 4), dtype=np.float32), 1)
    with pytest.raises(ValueError):
        index.search(np.ones(3, dtype=np.float32), 1)
    scores, ids = index.search(np.zeros((0, 3), dtype=np.float32), 2)
    assert scores.shape == (0, 2) and ids.shape == (0, 2)


def test_index_construction_checks() -> None:
    for bad in ([[0.0, 0.0], [1.0, 0.0]], [[np.nan, 1.0]], [[np.inf, 1.0]], [], [[]], [1.0, 2.0]):
        with pytest.raises(ValueError):
            ProfileIndex(np.asarray(bad, dtype=np.float32))
    with pytest.raises(ValueError):
        ProfileIndex([[1, 0]], utterances=["a", "b"])
    with pytest.raises(TypeError):
        ProfileIndex([[1, 0]], utterances="a")
    with pytest.raises(ValueError):
        ProfileIndex([[1, 0]], fingerprint=EmbeddingFingerprint("m", "0", 3, True))
    with pytest.raises(ValueError):
        ProfileIndex([[1, 0]], backend="faiss", device="cuda:0")
    with pytest.raises(ValueError):
        ProfileIndex([[1, 0]], backend="nope")  # type: ignore[arg-type]


def test_as_embedding_matrix_checks() -> None:
    good = np.asarray([[1, 2], [3, 4]], dtype=np.float64)
    out = as_embedding_matrix(good, rows=2, dimension=2)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    assert out.tolist() == [[1, 2], [3, 4]]
    transposed = np.asarray([[1, 3], [2, 4]], dtype=np.float32).T
    assert as_embedding_matrix(transposed, rows=2).flags.c_contiguous
    cases = [
        (None, {}),
        (good, {"rows": 3}),
        (good, {"dimension": 3}),
        (good[:, :0], {}),
        (good[0], {}),
        (np.asarray([[1, np.nan], [1, 1]]), {}),
        (np.asarray([[0, 0], [1, 1]]), {}),
        ([["a", "b"], ["c", "d"]], {}),
    ]
    for raw, kwargs in cases:
        with pytest.raises(InvalidEmbeddingError):
            as_embedding_matrix(raw, **{"rows": 2, **kwargs})  # type: ignore[arg-type]
    zero_ok = as_embedding_matrix(np.zeros((1, 2)), rows=1, allow_zero_rows=True)
    assert zero_ok.tolist() == [[0.0, 0.0]]
    assert issubclass(InvalidEmbeddingError, RuntimeError)


def test_l2_normalize_rows_handles_tiny_and_zero_rows() -> None:
    matrix = np.asarray([[3e-30, 4e-30], [0, 0], [1e-45, 0]], dtype=np.float32)
    normalized, norms = l2_normalize_rows(matrix)
    np.testing.assert_allclose(normalized, [[0.6, 0.8], [0, 0], [1, 0]], atol=1e-6)
    assert norms[1] == 0.0 and norms[0] > 0 and norms[2] > 0


# -- persistence ------------------------------------------------------------------------------

ENTRIES = [("code", "write a function"), ("code", "fix this bug"), ("chat", "hello there")]
TABLE = {
    "write a function": [1.0, 0.0],
    "fix this bug": [0.9, 0.1],
    "hello there": [0.0, 1.0],
    "good morning": [0.1, 0.9],
    "refactor it": [0.8, 0.2],
}


async def test_index_save_and_load_round_trip(tmp_path: Path) -> None:
    gen = FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT)
    index = await ProfileIndex.build(gen, ENTRIES)
    index.save(tmp_path / "idx")
    loaded = ProfileIndex.load(tmp_path / "idx", gen)
    assert loaded.utterances == index.utterances == tuple(u for _, u in ENTRIES)
    assert loaded.labels == ("code", "code", "chat")
    assert loaded.fingerprint == FINGERPRINT
    assert np.array_equal(loaded.vectors, index.vectors)
    query = np.asarray([[0.7, 0.3]], dtype=np.float32)
    assert loaded.search(query, 3)[1].tolist() == index.search(query, 3)[1].tolist()
    # A fingerprint object is accepted in place of the generator.
    assert len(ProfileIndex.load(tmp_path / "idx", FINGERPRINT)) == 3


async def test_index_load_refuses_another_fingerprint(tmp_path: Path) -> None:
    gen = FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT)
    (await ProfileIndex.build(gen, ENTRIES)).save(tmp_path)
    for other in (
        EmbeddingFingerprint("other-model", FINGERPRINT.weights_sha256, 2, True),
        EmbeddingFingerprint(FINGERPRINT.model, "f" * 64, 2, True),
        EmbeddingFingerprint(FINGERPRINT.model, FINGERPRINT.weights_sha256, 2, False),
    ):
        with pytest.raises(FingerprintMismatchError, match="rebuild"):
            ProfileIndex.load(tmp_path, FakeEmbeddingGenerator(TABLE, fingerprint=other))
    with pytest.raises(FingerprintMismatchError, match="no fingerprint"):
        ProfileIndex.load(tmp_path, FakeEmbeddingGenerator(TABLE))
    assert issubclass(FingerprintMismatchError, RuntimeError)


async def test_index_load_rejects_missing_or_corrupt_files(tmp_path: Path) -> None:
    gen = FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT)
    with pytest.raises(IndexFormatError, match="no saved profile index"):
        ProfileIndex.load(tmp_path / "missing", gen)
    (await ProfileIndex.build(gen, ENTRIES)).save(tmp_path)
    vectors = np.load(tmp_path / "vectors.npy")
    np.save(tmp_path / "vectors.npy", vectors[::-1].copy())
    with pytest.raises(IndexFormatError, match="hash"):
        ProfileIndex.load(tmp_path, gen)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IndexFormatError, match="version"):
        ProfileIndex.load(tmp_path, gen)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(IndexFormatError):
        ProfileIndex.load(tmp_path, gen)


def test_index_save_needs_utterances_and_fingerprint(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="utterances"):
        ProfileIndex([[1, 0]], fingerprint=FINGERPRINT).save(tmp_path)
    with pytest.raises(ValueError, match="fingerprint"):
        ProfileIndex([[1, 0]], utterances=["a"]).save(tmp_path)


# -- incremental rebuild ----------------------------------------------------------------------


async def test_index_rebuild_embeds_only_changed_and_added_utterances() -> None:
    gen = FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT)
    first = await ProfileIndex.build(gen, ENTRIES)
    assert gen.calls == [["write a function", "fix this bug", "hello there"]]
    changed = [
        ("code", "write a function"),
        ("code", "refactor it"),  # changed from "fix this bug"
        ("chat", "hello there"),
        ("chat", "good morning"),  # added
        ("code", "hello there"),  # same text under another route: a new pair
    ]
    second = await ProfileIndex.build(gen, changed, previous=first)
    assert gen.calls[1:] == [["refactor it", "good morning", "hello there"]]
    assert second.labels == tuple(label for label, _ in changed)
    fresh = await ProfileIndex.build(
        FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT), changed
    )
    np.testing.assert_array_equal(second.vectors, fresh.vectors)
    # Removing entries and reordering embeds nothing.
    third = await ProfileIndex.build(gen, list(reversed(changed[:3])), previous=second)
    assert len(gen.calls) == 2 and len(third) == 3
    assert third.utterances == ("hello there", "refactor it", "write a function")


async def test_index_rebuild_with_another_model_embeds_everything() -> None:
    first = await ProfileIndex.build(
        FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT), ENTRIES
    )
    other = EmbeddingFingerprint("other", "1" * 64, 2, True)
    for gen in (FakeEmbeddingGenerator(TABLE, fingerprint=other), FakeEmbeddingGenerator(TABLE)):
        await ProfileIndex.build(gen, ENTRIES, previous=first)
        assert gen.calls == [[u for _, u in ENTRIES]]


async def test_index_rebuild_checks_dimension_and_input() -> None:
    gen = FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT)
    first = await ProfileIndex.build(gen, ENTRIES)
    gen.transform = lambda m: np.concatenate([m, m], axis=1)
    with pytest.raises(InvalidEmbeddingError, match="dimension"):
        await ProfileIndex.build(gen, [*ENTRIES, ("chat", "good morning")], previous=first)
    with pytest.raises(ValueError):
        await ProfileIndex.build(gen, [])
    with pytest.raises(ValueError):
        await ProfileIndex.build(gen, [("code", "  ")])
    with pytest.raises(TypeError):
        await ProfileIndex.build(gen, [("code", 3)])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        await ProfileIndex.build(None, ENTRIES)  # type: ignore[arg-type]


async def test_index_load_or_build_reuses_and_saves(tmp_path: Path) -> None:
    gen = FakeEmbeddingGenerator(TABLE, fingerprint=FINGERPRINT)
    path = tmp_path / "profiles"
    await ProfileIndex.load_or_build(path, gen, ENTRIES)
    assert (path / "manifest.json").exists() and len(gen.calls) == 1
    again = await ProfileIndex.load_or_build(path, gen, ENTRIES)
    assert len(gen.calls) == 1 and len(again) == 3
    await ProfileIndex.load_or_build(path, gen, [*ENTRIES, ("chat", "good morning")])
    assert gen.calls[1:] == [["good morning"]]
    assert len(ProfileIndex.load(path, gen)) == 4
    other = EmbeddingFingerprint("other", "1" * 64, 2, True)
    regen = FakeEmbeddingGenerator(TABLE, fingerprint=other)
    await ProfileIndex.load_or_build(path, regen, ENTRIES)
    assert regen.calls == [[u for _, u in ENTRIES]]
    assert ProfileIndex.load(path, regen).fingerprint == other
