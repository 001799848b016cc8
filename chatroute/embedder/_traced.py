"""A packed forward pass as one module, and its TorchScript trace, which runs without the GIL.

An eager forward pass is Python calling one operator after another, and each call gives
up the GIL and takes it back. In a service, the event loop thread holds the GIL while it
answers requests, so each operator of a pass may wait for it: with a pure-Python thread
busy beside it, 20 packed passes of 32 texts took 17-18 s on one core instead of 2.1 s.
Traced, the whole pass (attention mask, transformer, pooling, normalisation) is one call
that releases the GIL once, and alone it is a few per cent faster.

The trace holds the model's own parameters (no copy) and is used only where it gives the
eager module's vectors on probe batches of different shapes; anything else (a model the
tracer cannot follow, a torch without TorchScript) keeps the eager module.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["PackedInputs", "PackedPass", "trace_packed"]

logger = logging.getLogger(__name__)

PackedInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A packed pass's inputs: token ids, the text owning each slot (-1: empty) and each
slot's position within its text, all (rows, width); the flat slot of every token in text
order; the texts' token offsets (texts + 1)."""


class PackedPass(torch.nn.Module):
    """A packed batch through a sentence-transformer: each text keeps its own positions and
    attends only to itself; its token states are pooled as the model's own pooling does
    for an unpadded (flattened) batch. Returns the vectors, one row per text."""

    def __init__(
        self,
        modules: Sequence[torch.nn.Module],
        *,
        dtype: torch.dtype,
        type_ids: bool,
        prompt_length: int | None,
        normalize: bool,
    ) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleList(modules)  # the model's own modules, shared
        self.dtype = dtype
        self.type_ids = type_ids
        self.prompt_length = prompt_length
        self.normalize = normalize

    def forward(
        self,
        input_ids: torch.Tensor,
        owner: torch.Tensor,
        position_ids: torch.Tensor,
        dest: torch.Tensor,
        bounds: torch.Tensor,
    ) -> torch.Tensor:
        width = owner.shape[1]
        same_text = owner[:, :, None] == owner[:, None, :]
        # Empty slots attend to themselves only.
        same_text = same_text | torch.eye(width, dtype=torch.bool, device=owner.device)
        mask = torch.zeros(same_text.shape, dtype=self.dtype, device=owner.device)
        mask = mask.masked_fill(~same_text, torch.finfo(self.dtype).min)
        features: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask[:, None],
            "position_ids": position_ids,
        }
        if self.type_ids:
            features["token_type_ids"] = torch.zeros_like(input_ids)
        stages = list(self.stages)
        states = stages[0](features)["token_embeddings"]
        flat = states.reshape(-1, states.shape[-1])[dest]
        pooled: dict[str, Any] = {"token_embeddings": flat[None], "cu_seq_lens_q": bounds}
        if self.prompt_length is not None:
            pooled["prompt_length"] = self.prompt_length
        for module in stages[1:]:
            pooled = module(pooled)
        out: torch.Tensor = pooled["sentence_embedding"]
        if self.normalize:
            out = torch.nn.functional.normalize(out.to(torch.float32), p=2, dim=1)
        return out


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Only errors from logger `name` (and below it) meanwhile."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def trace_packed(
    eager: PackedPass, probes: Sequence[PackedInputs], *, tolerance: float
) -> Callable[..., torch.Tensor] | None:
    """`eager` traced on the first probe, or None. The trace is kept only if, on every
    probe, its vectors equal `eager`'s within `tolerance` (the probes should differ in
    their rows, widths and texts)."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # TorchScript is deprecated in favour of torch.compile and torch.export, which
            # compile (seconds to minutes at start-up) and still call back into Python; the
            # tracer also warns about a branch on a constant (`is_causal` with a mask given).
            warnings.simplefilter("ignore")
            trace: Callable[..., Any] = torch.jit.trace
            with _quiet("transformers"):  # the tracer reads every attribute, noisy ones too
                traced = trace(eager.eval(), probes[0], check_trace=False)
        with torch.inference_mode():
            for inputs in probes:
                want = eager(*inputs)
                got = traced(*inputs)
                if got.shape != want.shape or not torch.allclose(got, want, atol=tolerance, rtol=0):
                    logger.info("embedder: the traced forward pass differs; passes stay eager")
                    return None
    except Exception as exc:
        logger.info(
            "embedder: the forward pass could not be traced (%s); passes stay eager",
            type(exc).__name__,
        )
        logger.debug("embedder: tracing failed", exc_info=True)
        return None
    result: Callable[..., torch.Tensor] = traced
    return result
