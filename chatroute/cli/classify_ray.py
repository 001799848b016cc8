"""The Ray engine of `chatroute classify`: Ray Data reads, router actors decide, workers write."""

from __future__ import annotations

import asyncio
import io
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from chatroute.cli.classify import messages_query
from chatroute.cli.classify_layout import Layout, results_of
from chatroute.cli.classify_read import Fields, InputError, Reader, RowBatch, open_stream
from chatroute.cli.classify_resume import scoring_mode
from chatroute.cli.classify_write import OutputSpec, scan_output
from chatroute.config import ChatrouteConfig

if TYPE_CHECKING:
    from rich.console import Console

    from chatroute.cli.classify_command import ClassifyOptions
    from chatroute.cli.classify_summary import Summary

__all__ = ["TooManyBadRows", "run_ray", "start_local_ray"]

_EXTENSIONS = {"jsonl": ["jsonl", "ndjson", "json"], "csv": ["csv"], "parquet": ["parquet", "pq"]}
LOCAL_CPUS = 2
# Rows a Ray read task puts in one block at least (more when --batch-size is larger): big
# enough that a block's overhead in Ray stays small next to deciding its rows.
MIN_BLOCK_ROWS = 1024


class TooManyBadRows(Exception):
    """Raised in a router actor once the run's bad rows pass --max-bad."""


def start_local_ray(cpus: float = LOCAL_CPUS, gpus: float = 0.0) -> None:
    """Start a Ray instance on this machine only: every Ray process listens on 127.0.0.1,
    `cpus` CPUs, no dashboard, no usage report."""
    # Ray takes 127.0.0.1 as the node address (so that the GCS, the raylet, the object
    # manager, the agents and the workers bind it) only with its cluster switch off; the
    # switch is read when Ray is imported, so an already imported Ray is told directly.
    switch = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    before = os.environ.get(switch)
    os.environ[switch] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray._private import ray_constants

    cluster = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            num_cpus=max(math.ceil(cpus), 1),
            num_gpus=math.ceil(gpus) or None,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=512 * 1024 * 1024,
            log_to_driver=False,
            configure_logging=False,
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster
        if before is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = before


def _check_reachable(address: str) -> None:
    """InputError naming `address` when nothing answers there (Ray would retry for a minute)."""
    if address in ("auto", "local"):
        return
    target = address.removeprefix("ray://").rstrip("/")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--ray-address {address}: expected HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise InputError(f"cannot reach the Ray cluster at {address}: {reason}") from None


def _connect(options: ClassifyOptions) -> bool:
    """Connect to the cluster or start a local instance; whether to shut it down after."""
    import ray

    if options.ray_address:
        _check_reachable(options.ray_address)
    if ray.is_initialized():
        return False
    if options.ray_address:
        try:
            ray.init(address=options.ray_address, log_to_driver=False, configure_logging=False)
        except Exception as exc:  # Ray's ConnectionError, RuntimeError, ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"cannot join the Ray cluster at {options.ray_address}: {first}")
        return True
    cpus = max(LOCAL_CPUS, options.num_actors * _cpus_per_actor(options))
    start_local_ray(cpus, options.num_actors * options.gpus_per_actor)
    return True


def _cpus_per_actor(options: ClassifyOptions) -> float:
    if options.cpus_per_actor is not None:
        return options.cpus_per_actor
    if options.ray_address:
        return 1.0
    return max(LOCAL_CPUS / options.num_actors, 0.5)


def _input_block(batch: RowBatch, reader: Reader) -> Any:
    """A batch's usable rows as the Arrow block the router actors take."""
    import pyarrow as pa

    from chatroute.cli.classify_layout import _as_text

    columns: dict[str, Any] = {
        "line": pa.array(batch.lines, pa.int64()),
        "text": pa.array(batch.texts, pa.string()),
        # A messages row's conversation, so the actor decides its turn in context.
        "_conversation": pa.array(
            [getattr(text, "source", None) for text in batch.texts], pa.string()
        ),
    }
    if reader.has_id:
        ids = batch.ids if reader.id_type is not None else [_as_text(v) for v in batch.ids]
        columns["id"] = pa.array(ids, reader.id_type or pa.string())
    for name, kind in reader.keep_types.items():
        values = batch.keep[name] if kind is not None else [_as_text(v) for v in batch.keep[name]]
        columns[name] = pa.array(values, kind or pa.string())
    return pa.table(columns)


def _datasource(
    paths: str, fmt: str, fields: Fields, block_rows: int, tally: Any, max_bad: int | None
) -> Any:
    """A Ray Data file source reading with the local engine's readers (same rows, same bad
    rows, same line numbers).

    Bad rows are counted where they are read: a run past --max-bad stops there, without
    waiting for the router actors (and their model) to reach them.
    """
    from ray.data.datasource import FileBasedDatasource

    class ClassifyDatasource(FileBasedDatasource):  # type: ignore[misc]
        def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
            if fmt == "parquet":  # random access for the footer
                return filesystem.open_input_file(path)
            return super()._open_input_source(filesystem, path, **open_args)

        def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
            import ray

            fh = f if fmt == "parquet" else io.BufferedReader(f, 1 << 20)
            reader = open_stream(fh, fmt, path, fields, None)
            for batch in reader.batches(block_rows):
                if batch.bad:
                    bad = [(row.line, row.reason) for row in batch.bad]
                    total = ray.get(tally.add_bad.remote(bad))
                    if max_bad is not None and total > max_bad:
                        raise TooManyBadRows(f"more than {max_bad} bad rows ({total})")
                yield _input_block(batch, reader)

    return ClassifyDatasource(paths, file_extensions=_EXTENSIONS[fmt])


class _RouterActor:
    """One Ray actor: builds the router once (model, index), then decides input blocks."""

    def __init__(
        self,
        config: ChatrouteConfig,
        layout: Layout,
        scoring: str,
        tally: Any,
        gpu: bool,
    ) -> None:
        from chatroute.engine import build_engine

        if gpu:
            embedder = config.embedder.model_copy(update={"device": "cuda", "dtype": "fp16"})
        else:
            embedder = config.embedder.model_copy(update={"device": "cpu"})
        config = config.model_copy(update={"embedder": embedder})
        self._loop = asyncio.new_event_loop()
        self._engine = build_engine(config)
        self._loop.run_until_complete(self._engine.warm())  # model, index (index_path)
        self._layout = layout
        self._scoring = scoring
        self._tally = tally

    def __call__(self, block: Any) -> Any:
        data = block.to_pydict()
        batch = RowBatch(
            lines=data["line"],
            texts=[
                messages_query(conversation) if conversation else text
                for text, conversation in zip(data["text"], data["_conversation"], strict=True)
            ],
            ids=data["id"] if self._layout.has_id else [None] * len(data["line"]),
            keep={name: data[name] for name in self._layout.keep_types},
        )
        decisions = self._loop.run_until_complete(self._engine.decide_batch(batch.texts))
        results = results_of(
            decisions,
            self._engine.route_name,
            self._scoring,
            with_scores=self._layout.with_scores,
        )
        self._tally.add_rows.remote(len(results))
        return self._layout.table(batch, results)


class _Tally:
    """Rows decided (by the actors) and bad rows seen (by the readers); the driver drains
    the bad rows to report them."""

    def __init__(self) -> None:
        self.rows = 0
        self.bad_total = 0
        self.bad: list[tuple[int, str]] = []

    def add_rows(self, count: int) -> None:
        self.rows += count

    def add_bad(self, rows: list[tuple[int, str]]) -> int:
        self.bad.extend(rows)
        self.bad_total += len(rows)
        return self.bad_total

    def drain(self) -> tuple[int, list[tuple[int, str]]]:
        bad, self.bad = self.bad, []
        return self.rows, bad


def _probe(options: ClassifyOptions, fmt: str) -> Reader:
    """Open the input's first file on the driver: its columns are checked before Ray starts."""
    import pyarrow.fs as pafs

    source = options.source
    location = source if "://" in source else os.path.abspath(source)
    try:
        filesystem, path = pafs.FileSystem.from_uri(location)
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            found = [
                item.path
                for item in filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
                if item.is_file
                and item.path.rsplit(".", 1)[-1].lower() in _EXTENSIONS[fmt]
                and not os.path.basename(item.path).startswith(("_", "."))
            ]
            if not found:
                raise InputError(f"no {fmt} files under {source}")
            path = sorted(found)[0]
        elif info.type == pafs.FileType.NotFound:
            raise InputError(f"no such input: {source}")
        if fmt == "parquet":
            fh = filesystem.open_input_file(path)
        else:
            fh = io.BufferedReader(filesystem.open_input_stream(path), 1 << 20)
    except OSError as exc:
        raise InputError(f"cannot read {source}: {exc}") from None
    reader = open_stream(fh, fmt, path, options.fields, None)
    reader.owned.append(fh)
    return reader


def run_ray(
    config: ChatrouteConfig,
    options: ClassifyOptions,
    fmt: str,
    spec: OutputSpec,
    summary: Summary,
    console: Console,
) -> tuple[int, dict[str, Any]]:
    """Classify with Ray Data into the folder `spec`; (rows classified, extra summary keys).

    The summary is then counted from the part files written. InputError for an input or
    a cluster that cannot be used; TooManyBadRows past --max-bad.
    """
    import ray
    import ray.data

    from chatroute.cli.classify_command import ClassifyFailure, _progress

    try:
        probe = _probe(options, fmt)
    except InputError as exc:
        raise ClassifyFailure(str(exc)) from None
    layout = Layout.of(probe, list(config.routes), with_scores=options.scores).as_text()
    probe.close()
    try:
        owned = _connect(options)
    except InputError as exc:
        raise ClassifyFailure(str(exc)) from None
    # Ray Data logs notices and, for a failed run, whole stack traces: the run's own
    # messages (bad rows, the one-line failure) say what the user needs.
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    started = time.perf_counter()
    try:
        tally: Any = ray.remote(num_cpus=0)(_Tally).remote()
        source = options.source if "://" in options.source else os.path.abspath(options.source)
        dataset = ray.data.read_datasource(
            _datasource(
                source,
                fmt,
                options.fields,
                max(options.batch_size, MIN_BLOCK_ROWS),
                tally,
                options.max_bad,
            ),
            num_cpus=0,
        ).map_batches(
            _RouterActor,
            fn_constructor_kwargs={
                "config": config,
                "layout": layout,
                "scoring": scoring_mode(config),
                "tally": tally,
                "gpu": options.gpus_per_actor > 0,
            },
            batch_size=options.batch_size,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=options.num_actors),
            num_cpus=_cpus_per_actor(options),
            num_gpus=options.gpus_per_actor or None,
        )
        failure: list[BaseException] = []
        target = spec.target if "://" in spec.target else os.path.abspath(spec.target)

        def write() -> None:
            writers = {
                "parquet": dataset.write_parquet,
                "jsonl": dataset.write_json,
                "csv": dataset.write_csv,
            }
            try:
                writers[spec.fmt](
                    target,
                    min_rows_per_file=options.part_rows,
                    ray_remote_args={"num_cpus": 0},
                )
            except BaseException as exc:
                failure.append(exc)

        worker = threading.Thread(target=write, name="chatroute-ray-write", daemon=True)
        bar = _progress(console, options.progress)
        task = bar.add_task("classify", total=probe.total if fmt == "parquet" else None)
        bad_seen = 0
        with bar:
            worker.start()
            while True:
                worker.join(0.5)
                rows, bad = ray.get(tally.drain.remote())
                for line, reason in bad:
                    console.print(f"{options.source}: row {line}: skipped: {reason}", markup=False)
                bad_seen += len(bad)
                bar.update(task, completed=rows + bad_seen, inputs=rows)
                if not worker.is_alive():
                    break
        if failure:
            if options.max_bad is not None and bad_seen > options.max_bad:
                raise ClassifyFailure(
                    f"more than {options.max_bad} bad rows ({bad_seen}); stopped", 1
                )
            raise _failure(failure[0])
    finally:
        if owned:
            ray.shutdown()
    elapsed = time.perf_counter() - started
    written = OutputSpec(spec.target, spec.fmt, True, spec.part_rows)
    _, _, counted = scan_output(written, list(config.routes))
    summary.merge(counted)
    summary.bad = bad_seen
    return counted.total, {"engine": "ray", "actors": options.num_actors, "seconds_ray": elapsed}


def _failure(exc: BaseException) -> Exception:
    """The one-line error for a failed Ray run (the cause inside Ray's wrapping)."""
    from chatroute.cli.classify_command import ClassifyFailure

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TooManyBadRows):
            return ClassifyFailure(str(seen).splitlines()[0], 1)
        if isinstance(seen, InputError):
            return ClassifyFailure(str(seen).splitlines()[-1], 2)
        seen = getattr(seen, "cause", None) or seen.__cause__
    text = str(exc).strip().splitlines()
    return ClassifyFailure(f"the Ray run failed: {text[-1] if text else type(exc).__name__}", 1)
