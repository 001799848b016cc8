"""The EmbeddingGenerator contract: texts in, a float32 matrix out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import numpy as np
import numpy.typing as npt

__all__ = ["EmbeddingFingerprint", "EmbeddingGenerator"]


@dataclass(frozen=True)
class EmbeddingFingerprint:
    """Identifies the vectors a generator makes: saved indexes are refused under another one."""

    model: str
    weights_sha256: str
    dimension: int
    normalized: bool


class EmbeddingGenerator(ABC):
    """Turns texts into vectors: `generate(values)` returns shape (len(values), dim), float32."""

    @property
    def fingerprint(self) -> EmbeddingFingerprint | None:
        """What identifies this generator's vectors; None when it cannot say."""
        return None

    @abstractmethod
    async def generate(self, values: Sequence[str]) -> npt.NDArray[np.float32]:
        """Embed `values` in order."""

    async def aclose(self) -> None:
        """Release owned resources; idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
