"""Model side of the embedder: loading, tokenisation into segments, and the forward pass.

The fast path bypasses `SentenceTransformer.encode`: the model's Rust tokeniser (a private
copy per thread, it releases the GIL) turns texts into padded id rows, and a forward pass is
the model's own modules (transformer, pooling, normalisation) called on a collated batch under
`torch.inference_mode()`. Models the fast path cannot serve exactly (decoder-style embedders,
chat templates, slow tokenisers, ...) fall back to `encode` per batch.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from chatroute.embedder._batcher import Batch, IntArray, Request, Segment, pack_rows
from chatroute.embedder._locate import (
    DEFAULT_MODEL_NAME,
    FP16_ON_CPU,
    cached_snapshot,
    env_offline,
    locate,
    offline_state,
)
from chatroute.embedder._traced import PackedInputs, PackedPass, trace_packed
from chatroute.embedder.errors import EmbedderLoadError

__all__ = ["DEFAULT_MODEL_NAME", "ModelRunner", "PendingResult", "offline_state"]

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_ALT_BACKEND_DIRS = {"onnx", "openvino"}
_PROBE_TEXTS = [
    "Hello world, this is a tokeniser probe.",
    "ÜMLAUTS and accents: école, naïve; digits 12345 & symbols #@!",
    "",
]

FloatArray = npt.NDArray[np.float32]


class PendingResult(Protocol):
    """A launched forward pass; `result()` waits for it and returns rows in batch order."""

    def result(self) -> FloatArray: ...


@dataclass
class _Ready:
    value: FloatArray

    def result(self) -> FloatArray:
        return self.value


@dataclass
class _OnDevice:
    """A CUDA forward pass still running: its output is being copied into pinned memory."""

    host: torch.Tensor
    event: Any  # torch.cuda.Event

    def result(self) -> FloatArray:
        self.event.synchronize()
        out: FloatArray = self.host.numpy()
        return out


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when available, else the CPU."""
    if isinstance(device, str) and device == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device()) if _cuda_ok() else torch.device("cpu")
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}"
        ) from exc
    if dev.type == "cuda":
        if not _cuda_ok():
            raise EmbedderLoadError(f"device {device!r} was requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return dev


def _cuda_ok() -> bool:
    return bool(torch.cuda.is_available())


_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is fp16 on CUDA and fp32 on the CPU; fp16 is refused on the CPU."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        resolved = torch.float16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str) and dtype.lower() in _DTYPES:
        resolved = _DTYPES[dtype.lower()]
    else:
        raise ValueError(f"dtype must be 'auto', 'fp16', 'bf16' or 'fp32', got {dtype!r}")
    if resolved not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be fp16, bf16 or fp32, got {resolved}")
    if device.type == "cpu" and resolved == torch.float16:
        raise ValueError(FP16_ON_CPU)
    return resolved


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _weight_files(folder: Path) -> list[Path]:
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or path.suffix not in _WEIGHT_SUFFIXES:
            continue
        if set(rel.parts[:-1]) & _ALT_BACKEND_DIRS or rel.parts[0].startswith("."):
            continue
        found.append(path)
    return found


def _state_dict_sha256(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


class ModelRunner:
    """A loaded sentence-transformers model: tokenises texts into segments and embeds batches."""

    def __init__(
        self,
        model: str,
        *,
        device: str | torch.device,
        dtype: str | torch.dtype,
        normalize: bool,
        fast_path: bool = True,
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise ValueError(
                f"model must be 'default', a local folder or a model name, got {model!r}"
            )
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.name, target, folder = locate(model)
        self._st = _load(model, target, self.device)
        self._folder = folder if folder is not None else cached_snapshot(target)
        self._weights_files = _weight_files(self._folder) if self._folder is not None else []
        # Without weight files to hash, hash the parameters now, before any dtype change.
        self._weights_sha: str | None = (
            None if self._weights_files else _state_dict_sha256(self._st)
        )
        self._sha_lock = threading.Lock()
        if self.dtype != torch.float32:
            self._st.to(self.dtype)
        self._st.eval()

        dim = self._st.get_embedding_dimension()
        if not isinstance(dim, int) or dim < 1:
            raise EmbedderLoadError(f"model {self.name!r} does not report an embedding dimension")
        self.dimension = dim
        seq = self._st.max_seq_length
        self.max_seq_length = int(seq) if isinstance(seq, int) and seq > 0 else 512
        self.model_normalizes = any(type(m).__name__ == "Normalize" for m in self._st)
        self._normalize_out = normalize and not self.model_normalizes
        self.normalized = normalize or self.model_normalizes
        self.pipelined = self.device.type == "cuda"

        self._prompt = _default_prompt(self._st)
        self._prompt_length: int | None = None
        self._pad_id = 0
        self._type_ids = False
        self._tokenizer_json: str | None = None
        self._local = threading.local()
        self.fast = fast_path and self._setup_fast_path()
        if not self.fast:
            logger.info("embedder: %s runs through SentenceTransformer.encode per batch", self.name)
        self._pass: Callable[..., torch.Tensor] | None = None  # set by `_setup_packing`
        self.packs = self.fast and self._setup_packing()

    # -- identity -----------------------------------------------------------------------------

    @property
    def weights_sha256(self) -> str:
        """SHA-256 of the weight file (or of the sorted weight files' digests); computed once."""
        with self._sha_lock:
            if self._weights_sha is None:
                files = self._weights_files
                assert self._folder is not None
                if len(files) == 1:
                    self._weights_sha = _hash_file(files[0])
                else:
                    digest = hashlib.sha256()
                    for path in files:
                        rel = path.relative_to(self._folder).as_posix()
                        digest.update(f"{rel}\0{_hash_file(path)}\n".encode())
                    self._weights_sha = digest.hexdigest()
            return self._weights_sha

    # -- tokenisation -------------------------------------------------------------------------

    def _setup_fast_path(self) -> bool:
        """Use our own tokenise + collate + module forward when it provably matches `encode`."""
        first = self._st[0] if len(self._st) else None
        tok = getattr(first, "tokenizer", None)
        backend = getattr(tok, "backend_tokenizer", None)
        if (
            first is None
            or backend is None
            or getattr(first, "transformer_task", "feature-extraction") != "feature-extraction"
            or set(getattr(first, "modality_config", {"text": None})) != {"text"}
            or getattr(first, "can_flatten_inputs", False)
            or getattr(first, "query_expansion", None) is not None
            or getattr(tok, "padding_side", "right") != "right"
            or getattr(tok, "pad_token_id", None) is None
        ):
            return False
        assert tok is not None
        self._tokenizer_json = backend.to_str()
        self._pad_id = int(tok.pad_token_id)
        self._type_ids = "token_type_ids" in getattr(tok, "model_input_names", ())
        if self._prompt:
            length = getattr(first, "_get_prompt_length", lambda _p: None)(self._prompt)
            self._prompt_length = int(length) if isinstance(length, int) else None
        # Safety net: our tokenisation must equal the model's own on a probe.
        try:
            probe = [self._prompt + t for t in _PROBE_TEXTS]
            want = tok(probe, truncation=True, max_length=self.max_seq_length)["input_ids"]
            got = [e.ids for e in self._encode(probe)]
        except Exception:  # pragma: no cover - exotic tokenisers
            logger.debug("embedder fast path probe failed", exc_info=True)
            return False
        return [list(w) for w in want] == got

    def _tokenizer(self) -> Any:
        tok = getattr(self._local, "tok", None)
        if tok is None:
            from tokenizers import Tokenizer

            assert self._tokenizer_json is not None
            tok = Tokenizer.from_str(self._tokenizer_json)
            tok.no_padding()
            tok.enable_truncation(max_length=self.max_seq_length)
            self._local.tok = tok
        return tok

    def _encode(self, texts: list[str]) -> list[Any]:
        tok = self._tokenizer()
        encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
        return list(encode(texts, add_special_tokens=True))

    def make_segment(self, request: Request, start: int, texts: list[str]) -> Segment:
        """Tokenise `texts` (request positions start..) into a length-sorted segment."""
        n = len(texts)
        if not self.fast:
            # Only an ordering/budget estimate here: `encode` tokenises again per batch.
            est = np.fromiter((len(t) // 4 + 2 for t in texts), dtype=np.int64, count=n)
            est = np.minimum(est, self.max_seq_length)
            order = np.argsort(est, kind="stable")
            return Segment(
                request=request,
                positions=order + start,
                lengths=est[order],
                texts=[texts[i] for i in order],
            )
        if self._prompt:
            texts = [self._prompt + t for t in texts]
        encodings = self._encode(texts)
        id_lists = [e.ids for e in encodings]
        lengths = np.fromiter((len(ids) for ids in id_lists), dtype=np.int64, count=n)
        order = np.argsort(lengths, kind="stable")
        ids = np.full((n, int(lengths.max())), self._pad_id, dtype=np.int64)
        for row, k in enumerate(order.tolist()):
            ids[row, : lengths[k]] = id_lists[k]
        return Segment(request=request, positions=order + start, lengths=lengths[order], ids=ids)

    def token_count(self, segment: Segment) -> int:
        """Tokens the model reads for a segment's texts (special tokens included)."""
        if segment.texts is None:  # tokenised here: the lengths are the real ones
            return int(segment.lengths.sum())
        # The `encode` path only estimated the lengths: count with the model's tokeniser.
        features = self._st.tokenize(segment.texts)
        return int(features["attention_mask"].sum())

    # -- forward --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        """The context the model worker thread runs in."""
        with torch.inference_mode():
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    yield
            else:
                yield

    def launch(self, batch: Batch) -> PendingResult:
        """Start the forward pass for `batch` (must run inside `inference()`)."""
        if batch.width:
            out = self._forward_packed(batch)
        elif self.fast:
            ids, mask = self._collate(batch)
            out = self._forward_ids(ids, mask)
        else:
            texts = [seg.texts[i] for seg, offs in batch.parts for i in offs.tolist()]  # type: ignore[index]
            out = self._st.encode(
                texts,
                batch_size=len(texts),
                convert_to_tensor=True,
                normalize_embeddings=self._normalize_out,
                show_progress_bar=False,
            )
        out = out.to(torch.float32)
        if self.device.type == "cuda":
            host = torch.empty(out.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return _OnDevice(host=host, event=event)
        return _Ready(out.numpy())

    def _collate(self, batch: Batch) -> tuple[IntArray, IntArray]:
        width = batch.max_len
        ids = np.full((batch.size, width), self._pad_id, dtype=np.int64)
        row = 0
        for seg, offs in batch.parts:
            assert seg.ids is not None
            cols = min(width, seg.ids.shape[1])
            ids[row : row + len(offs), :cols] = seg.ids[offs, :cols]
            row += len(offs)
        lengths = batch.lengths
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        return ids, mask

    def _forward_ids(self, ids: IntArray, mask: IntArray) -> torch.Tensor:
        non_blocking = self.device.type == "cuda"
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=non_blocking)
        attention = torch.from_numpy(mask).to(self.device, non_blocking=non_blocking)
        features: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention}
        if self._type_ids:
            features["token_type_ids"] = torch.zeros_like(input_ids)
        if self._prompt_length is not None:
            features["prompt_length"] = self._prompt_length
        out: torch.Tensor = self._st(features)["sentence_embedding"]
        if self._normalize_out:
            out = torch.nn.functional.normalize(out.to(torch.float32), p=2, dim=1)
        return out

    # -- packed passes ------------------------------------------------------------------------

    def _setup_packing(self) -> bool:
        """Pack short texts into shared rows only where it provably gives the padded result:
        the first module feeds token ids to a transformer that takes position ids and a 4-D
        attention mask, and a probe embeds the same texts both ways."""
        first = self._st[0]
        model = getattr(first, "auto_model", None)
        if not isinstance(model, torch.nn.Module):
            return False
        passed = getattr(first, "model_forward_params", None)  # None: every model input
        try:
            takes = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            return False
        for name in ("attention_mask", "position_ids"):
            if name not in takes or (passed is not None and name not in passed):
                return False
        if getattr(getattr(model, "config", None), "_attn_implementation", "") not in (
            "sdpa",
            "eager",
        ):
            return False
        self._pass = self.packed_pass()
        try:
            texts = [*_PROBE_TEXTS, "a", "two words"]
            packed = self.packed_batch(texts, width=0)
            padded = Batch(parts=packed.parts, size=packed.size, max_len=packed.max_len)
            with self.inference():
                want = self._forward_ids(*self._collate(padded)).to(torch.float32)
                got = self._forward_packed(packed).to(torch.float32)
            same = packed.rows < len(texts) and bool(
                torch.allclose(got, want, atol=self._probe_tolerance, rtol=0)
            )
        except Exception:  # a model the packed call does not fit: padded passes only
            logger.debug("embedder packing probe failed", exc_info=True)
            self._pass = None
            return False
        if not same:
            logger.info("embedder: %s cannot pack texts into shared rows", self.name)
            self._pass = None
        elif self.device.type == "cpu":
            self._setup_trace(packed)
        return same

    @property
    def traced(self) -> bool:
        """Whether packed passes run as a TorchScript trace (`_setup_trace`)."""
        return self._pass is not None and not isinstance(self._pass, PackedPass)

    @property
    def _probe_tolerance(self) -> float:
        """How far a probe's vectors may differ from the reference's, by dtype."""
        return 1e-5 if self.dtype == torch.float32 else 2e-2

    def packed_batch(self, texts: list[str], width: int) -> Batch:
        """`texts` tokenised as one packed batch in rows of about `width` tokens (0: the
        longest text's length plus 4)."""
        seg = self.make_segment(Request(len(texts)), 0, texts)
        max_len = int(seg.lengths.max())
        starts, rows, row_width = pack_rows(seg.lengths, width or max_len + 4)
        offs = np.arange(len(texts), dtype=np.int64)
        return Batch(
            parts=[(seg, offs)],
            size=len(texts),
            max_len=max_len,
            width=row_width,
            starts=starts,
            rows=rows,
        )

    def packed_pass(self) -> PackedPass:
        """A new eager `PackedPass` over this model's modules (shared, not copied)."""
        return PackedPass(
            list(self._st),
            dtype=self.dtype,
            type_ids=self._type_ids,
            prompt_length=self._prompt_length,
            normalize=self._normalize_out,
        )

    def _setup_trace(self, probe: Batch) -> None:
        """Run packed passes as a trace (`_traced`) where it gives the same vectors:
        checked on the packing probe and on a batch of more rows and another width."""
        texts = [f"{t} {n}" for n in range(4) for t in _PROBE_TEXTS]
        other = self.packed_batch(texts, width=24)  # more rows, another width
        assert isinstance(self._pass, PackedPass)
        traced = trace_packed(
            self._pass,
            [self._packed_inputs(b) for b in (probe, other)],
            tolerance=self._probe_tolerance,
        )
        if traced is not None:
            self._pass = traced

    def _forward_packed(self, batch: Batch) -> torch.Tensor:
        """A packed batch through the model (`PackedPass`), traced where that was proven."""
        assert self._pass is not None
        return self._pass(*self._packed_inputs(batch))

    def _packed_inputs(self, batch: Batch) -> PackedInputs:
        """The `PackedPass` inputs of a packed batch, on the model's device."""
        assert batch.starts is not None
        width, rows = batch.width, batch.rows
        lengths = batch.lengths
        total = int(lengths.sum())
        first_token = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        within = np.arange(total, dtype=np.int64) - np.repeat(first_token, lengths)
        dest = np.repeat(batch.starts, lengths) + within  # flat position of every token
        ids = np.full(rows * width, self._pad_id, dtype=np.int64)
        pieces = []
        for seg, offs in batch.parts:
            assert seg.ids is not None
            rows_ids = seg.ids[offs]
            pieces.append(rows_ids[np.arange(rows_ids.shape[1]) < seg.lengths[offs][:, None]])
        ids[dest] = np.concatenate(pieces)
        positions = np.zeros(rows * width, dtype=np.int64)
        positions[dest] = within
        owner = np.full(rows * width, -1, dtype=np.int64)
        owner[dest] = np.repeat(np.arange(batch.size, dtype=np.int64), lengths)
        bounds = np.concatenate(([0], np.cumsum(lengths)))
        device = self.device
        return (
            torch.from_numpy(ids.reshape(rows, width)).to(device),
            torch.from_numpy(owner.reshape(rows, width)).to(device),
            torch.from_numpy(positions.reshape(rows, width)).to(device),
            torch.from_numpy(dest).to(device),
            torch.from_numpy(bounds).to(device),
        )

    def embed_direct(self, texts: Sequence[str]) -> FloatArray:
        """Embed without the batcher (warm-up and checks): one segment, one batch."""
        seg = self.make_segment(Request(len(texts)), 0, list(texts))
        offs = np.arange(len(texts), dtype=np.int64)
        batch = Batch(parts=[(seg, offs)], size=len(texts), max_len=int(seg.lengths.max()))
        with self.inference():
            rows = self.launch(batch).result()
        out = np.empty_like(rows)
        out[seg.positions] = rows
        return out

    def warm_up(self) -> None:
        """Run the first forward passes (kernel selection, allocator) before serving."""
        self.embed_direct(["warm up"])
        self.embed_direct([f"warm-up sentence number {i} for the embedder" for i in range(32)])


def _default_prompt(st: Any) -> str:
    name = getattr(st, "default_prompt_name", None)
    prompts = getattr(st, "prompts", None) or {}
    prompt = prompts.get(name, "") if name else ""
    return prompt if isinstance(prompt, str) else ""


def _load(model: str, target: str, device: torch.device) -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise EmbedderLoadError("sentence-transformers is not installed") from exc
    kwargs: dict[str, Any] = {"device": str(device)}
    if env_offline():
        kwargs["local_files_only"] = True
    try:
        return SentenceTransformer(target, **kwargs)
    except Exception as exc:
        raise EmbedderLoadError(
            f"could not load embedding model {model!r}: {type(exc).__name__}: {exc}; "
            f"{offline_state()}"
        ) from exc
