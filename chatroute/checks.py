"""What a config and a command need before any work: files, folders and the embedding model.

`load_checked` is what every command runs first (`chatroute check` included), so a config
that `check` accepts does not then fail `serve`, `route`, `classify`, `fit` or
`index build`, and one it refuses fails them all with the same message. It reads the file
(`load_config`: keys, values, URLs, headers, cross-references) and then checks what lies
outside the file: the thresholds file (readable, valid, naming the routes it may name,
values in range), the profile index folder (a folder, writable where it will be written)
and the embedding model (found, on a device that exists; `check_model_loads` loads it).
Problems are reported as `ConfigError`s naming the config key at fault. The checks of a
command's own paths (`input_file`, `output_file`, `index_folder`) raise `PathError`.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from chatroute.chat.embedding import EmbeddingGenerator
from chatroute.config import ChatrouteConfig, ConfigError, load_config

__all__ = [
    "PathError",
    "check_config",
    "check_model_loads",
    "config_problems",
    "index_folder",
    "input_file",
    "load_checked",
    "load_embedder",
    "output_file",
]

Problem = tuple[str, str]
_INDEX_MANIFEST = "manifest.json"  # what marks a folder as a saved profile index
_MODEL_MARKERS = ("modules.json", "config.json")  # sentence-transformers or transformers


class PathError(ValueError):
    """A path given to a command cannot be used; the message names the argument and why."""

    def __init__(self, what: str, path: str | os.PathLike[str], problem: str) -> None:
        self.what = what
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{what} {self.path}: {problem}")


def load_checked(
    path: str | os.PathLike[str],
    *,
    model: Literal["skip", "locate"] = "locate",
    environ: Mapping[str, str] | None = None,
    thresholds_may_be_missing: bool = False,
) -> ChatrouteConfig:
    """Read a config file and check everything it needs outside itself.

    Raises `ConfigError` (with the file as its source) listing every problem found.
    `model="locate"` checks that the embedding model can be found and its device and
    dtype exist, without loading it; `"skip"` leaves the model out.
    `thresholds_may_be_missing` (for `fit`, which writes that file): a
    `routing.thresholds_file` that does not exist yet is left out of the config returned.
    """
    config = load_config(path, environ=environ)
    thresholds = config.routing.thresholds_file
    if thresholds_may_be_missing and thresholds is not None and not Path(thresholds).exists():
        routing = config.routing.model_copy(update={"thresholds_file": None})
        config = config.model_copy(update={"routing": routing})
    check_config(config, model=model, source=str(path))
    return config


def check_config(
    config: ChatrouteConfig,
    *,
    model: Literal["skip", "locate"] = "locate",
    source: str | None = None,
) -> None:
    """Raise `ConfigError` when `config_problems` finds any."""
    problems = config_problems(config, model=model)
    if problems:
        raise ConfigError(problems, source)


def config_problems(
    config: ChatrouteConfig, *, model: Literal["skip", "locate"] = "locate"
) -> list[Problem]:
    """The (config key, message) problems of the files, folders and model a config names."""
    problems: list[Problem] = []
    embedder = config.embedder
    if embedder.pack_width and embedder.pack_width > (embedder.max_batch_tokens or 1024):
        problems.append(
            (
                "embedder.pack_width",
                f"{embedder.pack_width} is over max_batch_tokens "
                f"({embedder.max_batch_tokens}): a packed row must fit in one pass",
            )
        )
    routing = config.routing
    if routing.thresholds_file is not None:
        problems.extend(_thresholds_problems(config, routing.thresholds_file))
    if routing.index_path is not None:
        problem = index_folder_problem(Path(routing.index_path))
        if problem:
            problems.append(("routing.index_path", f"{routing.index_path}: {problem}"))
    if model == "locate":
        problems.extend(_model_problems(config))
    return problems


def load_embedder(config: ChatrouteConfig, *, source: str | None = None) -> EmbeddingGenerator:
    """The embedding model the config names, loaded; `ConfigError` when it cannot be."""
    from chatroute.embedder import EmbedderLoadError
    from chatroute.engine import build_embedder

    try:
        return build_embedder(config)
    except (EmbedderLoadError, ValueError, OSError, RuntimeError) as exc:
        message = f"the model could not be loaded: {_one_line(exc)}"
        raise ConfigError([("embedder.model", message)], source) from None


def check_model_loads(config: ChatrouteConfig, *, source: str | None = None) -> None:
    """Load the embedding model as `serve` does and close it; `ConfigError` when it fails."""
    asyncio.run(load_embedder(config, source=source).aclose())


# -- a command's own paths ---------------------------------------------------------------


def input_file(what: str, path: str | os.PathLike[str]) -> Path:
    """`path` as a readable file; `PathError` naming `what` otherwise."""
    file = Path(path)
    if not file.exists():
        raise PathError(what, file, "no such file")
    if file.is_dir():
        raise PathError(what, file, "is a folder; give the path of a file")
    if not os.access(file, os.R_OK):
        raise PathError(what, file, "cannot be read (permission denied)")
    return file


def output_file(
    what: str, path: str | os.PathLike[str] | None, *, not_same_as: Path | None = None
) -> Path | None:
    """`path` as a file that can be written (created or appended to); `PathError` otherwise.

    None (no output file: standard output) passes. `not_same_as` is the input file, which
    the output must not be.
    """
    if path is None:
        return None
    file = Path(path)
    if file.is_dir():
        raise PathError(what, file, "is a folder; give the path of a file")
    if not_same_as is not None and file.exists() and _same_file(file, not_same_as):
        raise PathError(what, file, "is the input file; write the output to another file")
    if file.exists():
        if not os.access(file, os.W_OK):
            raise PathError(what, file, "cannot be written (permission denied)")
        return file
    folder = file.parent
    if not folder.exists():
        raise PathError(what, file, f"the folder {folder} does not exist")
    if not folder.is_dir():
        raise PathError(what, file, f"{folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PathError(what, file, f"cannot create it: the folder {folder} is not writable")
    return file


def index_folder(what: str, path: str | os.PathLike[str]) -> Path:
    """`path` as a folder a profile index can be saved in; `PathError` otherwise."""
    folder = Path(path)
    problem = index_folder_problem(folder, must_write=True)
    if problem:
        raise PathError(what, folder, problem)
    return folder


def index_folder_problem(folder: Path, *, must_write: bool | None = None) -> str | None:
    """Why `folder` cannot hold a profile index, or None.

    It must be a folder (or not exist yet, under a folder that can be written), and it must
    hold an index already or be empty, so that no unrelated folder is written into.
    `must_write` None: writable only when it holds no index yet (an index that is up to
    date is only read, so a read-only index baked into an image is fine).
    """
    if folder.exists() and not folder.is_dir():
        return "is a file, not a profile index folder"
    if folder.is_dir():
        has_index = (folder / _INDEX_MANIFEST).is_file()
        if not has_index and any(folder.iterdir()):
            return (
                f"holds other files but no profile index ({_INDEX_MANIFEST}); "
                "give an empty or a new folder"
            )
        write = (not has_index) if must_write is None else must_write
        if write and not os.access(folder, os.W_OK | os.X_OK):
            return "cannot be written (permission denied)"
        return None
    parent = _nearest_existing(folder)
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable"
    return None


# -- helpers ------------------------------------------------------------------------------


def _thresholds_problems(config: ChatrouteConfig, path: str) -> list[Problem]:
    from chatroute.engine import load_thresholds

    try:
        thresholds = load_thresholds(path, config)
    except ConfigError as exc:
        return list(exc.problems)
    routing = config.routing
    limit = routing.top_k if routing.aggregation == "sum" else 1
    return [
        (
            f"routing.thresholds_file.{name}",
            f"{value:g} in {path} is out of range: a threshold lies in "
            f"[-{limit}, {limit}] for {routing.aggregation} aggregation",
        )
        for name, value in thresholds.items()
        if math.isnan(value) or not -limit <= value <= limit
    ]


def _model_problems(config: ChatrouteConfig) -> list[Problem]:
    from chatroute.embedder import EmbedderLoadError
    from chatroute.embedder._locate import cached_snapshot, env_offline, locate

    settings = config.embedder
    problems: list[Problem] = []
    try:
        _, target, folder = locate(settings.model)
    except EmbedderLoadError as exc:
        problems.append(("embedder.model", _one_line(exc)))
    else:
        if folder is not None:
            if not any((folder / marker).is_file() for marker in _MODEL_MARKERS):
                problems.append(
                    (
                        "embedder.model",
                        f"{settings.model!r} holds no sentence-transformers model "
                        f"(neither {' nor '.join(_MODEL_MARKERS)})",
                    )
                )
        elif env_offline() and cached_snapshot(target) is None:
            problems.append(
                (
                    "embedder.model",
                    f"{settings.model!r} is no local folder and no model in the Hugging Face "
                    "cache, and the machine is offline (HF_HUB_OFFLINE=1); give the path of "
                    "a model folder, or 'default'",
                )
            )
    problems.extend(_device_problems(settings.device, settings.dtype))
    return problems


def _device_problems(device_name: str, dtype: str) -> list[Problem]:
    """The device and dtype checks; torch (a second or more to import) only where CUDA matters.

    Whether CUDA is available decides only a CUDA device, and fp16 on 'auto' (fp16 runs on
    CUDA alone): a CPU device, or 'auto' with any other dtype, is answered from the names.
    """
    from chatroute.embedder._locate import FP16_ON_CPU, names_a_cpu

    half = dtype.lower() in ("fp16", "float16")
    if names_a_cpu(device_name):
        return [("embedder.dtype", FP16_ON_CPU)] if half else []
    if device_name == "auto" and not half:
        return []  # fp32 or bf16 runs on the CPU and on CUDA, 'auto' is fp16 or fp32 by device
    import torch

    from chatroute.embedder import EmbedderLoadError
    from chatroute.embedder._model import resolve_device, resolve_dtype

    try:
        device = (
            resolve_device(device_name)
            if device_name != "auto"
            else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
    except (EmbedderLoadError, ValueError) as exc:
        return [("embedder.device", _one_line(exc))]
    try:
        resolve_dtype(dtype, device)
    except ValueError as exc:
        return [("embedder.dtype", _one_line(exc))]
    return []


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()  # a relative path with no existing part: created in the working folder


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
