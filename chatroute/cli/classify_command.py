"""`chatroute classify`: options checked, output resumed or refused, an engine run, a summary."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from chatroute.cli.classify import BadLine
from chatroute.cli.classify_layout import OUTPUT_COLUMNS, Layout, Result
from chatroute.cli.classify_read import Fields, InputError, Reader, RowBatch, detect_format
from chatroute.cli.classify_resume import (
    Manifest,
    differences,
    fingerprint,
    read_manifest,
    remove_output,
    scoring_mode,
    write_manifest,
)
from chatroute.cli.classify_summary import Summary
from chatroute.cli.classify_write import OutputSpec, ResumeError, open_writer, scan_output
from chatroute.config import ChatrouteConfig, ConfigError

__all__ = ["ClassifyFailure", "ClassifyOptions", "run_classify"]


class ClassifyFailure(Exception):
    """A run that cannot go on: the message for the user and the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class ClassifyOptions:
    """Everything `chatroute classify` was asked to do (the command's options)."""

    source: str
    output: str
    input_format: str | None = None
    output_format: str | None = None
    fields: Fields = field(default_factory=Fields)
    scores: bool = False
    batch_size: int = 256
    part_rows: int = 20_000
    summary_file: Path | None = None
    max_bad: int | None = None
    overwrite: bool = False
    progress: bool = True
    engine: str = "local"
    ray_address: str | None = None
    num_actors: int = 1
    gpus_per_actor: float = 0.0
    cpus_per_actor: float | None = None

    def output_spec(self) -> OutputSpec:
        """Where and how the results are written ('-' is stdout; a name ending in '/' or an
        existing folder is a folder of part files, Parquet unless --output-format says)."""
        target = self.output
        folder = target != "-" and (
            target.endswith(("/", "\\")) or Path(target).is_dir() or self.engine == "ray"
        )
        if self.output_format is not None:
            fmt = self.output_format
        elif target == "-":
            fmt = "jsonl"
        elif folder:
            suffix = Path(target.rstrip("/")).suffix
            fmt = detect_format(target, None, option="--output-format") if suffix else "parquet"
        else:
            fmt = detect_format(target, None, option="--output-format")
        return OutputSpec(target.rstrip("/") or "/", fmt, folder, self.part_rows)

    def recorded(self, source_format: str, output_format: str) -> dict[str, Any]:
        """The options an output's fingerprint records (a resume must not change them)."""
        fields = self.fields
        return {
            "input": self.source if self.source == "-" else str(Path(self.source).resolve()),
            "input_format": source_format,
            "output_format": output_format,
            "text_field": fields.text,
            "messages_field": fields.messages,
            "id_field": fields.id,
            "keep": list(fields.keep),
            "scores": self.scores,
        }


class _InputsColumn(ProgressColumn):
    """Inputs classified so far and their rate."""

    def render(self, task: Task) -> Text:
        inputs = int(task.fields.get("inputs", 0))
        elapsed = task.elapsed or 0.0
        rate = inputs / elapsed if elapsed > 0 else 0.0
        return Text(f"{inputs:,} inputs  {rate:,.0f} inputs/s")


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]classify"),
        BarColumn(),
        _InputsColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
    )


@dataclass
class _Run:
    """The state one run accumulates: summary, bad rows, rows written, rows reached."""

    summary: Summary
    reader_where: Any
    console: Console
    max_bad: int | None
    written: int = 0
    reached: int = 0
    started: float = field(default_factory=time.perf_counter)

    def report_bad(self, bad: list[BadLine]) -> None:
        for row in bad:
            where = self.reader_where(row.line)
            self.console.print(f"{where}: skipped: {row.reason}", markup=False)
        self.summary.bad += len(bad)
        if self.max_bad is not None and self.summary.bad > self.max_bad:
            last = bad[-1].line
            raise ClassifyFailure(
                f"more than {self.max_bad} bad rows ({self.summary.bad}, the last at "
                f"{self.reader_where(last)}); stopped",
                1,
            )


def _prepare_output(
    spec: OutputSpec, found: dict[str, Any], options: ClassifyOptions, console: Console
) -> tuple[int, int, Summary | None, bool]:
    """Check an existing output against this run: (rows to skip, next part number, the
    summary of what it holds, whether it is already complete). Removes it for --overwrite,
    refuses (ClassifyFailure) an output that is not resumable or has another fingerprint."""
    if spec.stdout:
        return 0, 0, None, False
    exists = (
        (spec.path.is_dir() and any(spec.path.iterdir()))
        if spec.folder
        else spec.path.exists() and spec.path.stat().st_size > 0
    )
    if not exists:
        return 0, 0, None, False
    if options.overwrite:
        remove_output(spec)
        return 0, 0, None, False
    manifest = read_manifest(spec)
    if manifest is None:
        raise ClassifyFailure(
            f"{spec.target} exists and is not a resumable classify output (no "
            "fingerprint record beside it); --overwrite replaces it"
        )
    changes = differences(manifest.fingerprint, found)
    if changes:
        raise ClassifyFailure(
            f"{spec.target} was written with other settings ({'; '.join(changes)}); rerun "
            "with the same ones to resume, or --overwrite to start over"
        )
    if not manifest.complete and (
        (not spec.folder and spec.fmt == "parquet") or options.engine == "ray"
    ):
        what = "a Ray output" if options.engine == "ray" else "a single Parquet file"
        console.print(
            f"{spec.target}: an interrupted run; {what} cannot be resumed, starting over "
            "(a folder output resumes with the local engine)",
            markup=False,
        )
        remove_output(spec)
        return 0, 0, None, False
    try:
        last, parts, summary = scan_output(spec, list(found["routes"]))
    except ResumeError as exc:
        raise ClassifyFailure(f"{exc}; --overwrite to start over") from None
    return last, parts, summary, manifest.complete


def _finish(
    summary: Summary,
    options: ClassifyOptions,
    console: Console,
    *,
    classified: int,
    elapsed: float,
    extra: dict[str, Any],
    resumed_after: int = 0,
) -> int:
    rate = classified / elapsed if elapsed > 0 else 0.0
    console.print(summary.table())
    resumed = f" (resumed after line {resumed_after})" if resumed_after else ""
    console.print(
        f"classified {classified} inputs in {elapsed:.1f} s ({rate:,.0f} inputs/s){resumed}; "
        f"{summary.empty} empty; {summary.bad} bad rows; output: {options.output}",
        markup=False,
    )
    if options.summary_file is not None:
        document = summary.to_dict(
            classified=classified, seconds=round(elapsed, 3), inputs_per_s=round(rate, 1), **extra
        )
        options.summary_file.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    if summary.bad and (options.max_bad is None or summary.bad > options.max_bad):
        return 1
    return 0


def run_classify(config: ChatrouteConfig, options: ClassifyOptions, console: Console) -> int:
    """Run `chatroute classify`; the exit status (ClassifyFailure for a refused run)."""
    from chatroute.engine import load_thresholds

    try:
        source_format = detect_format(options.source, options.input_format)
        spec = options.output_spec()
    except InputError as exc:
        raise ClassifyFailure(str(exc)) from None
    clash = set(options.fields.keep) & {*OUTPUT_COLUMNS, "scores"}
    if clash:
        raise ClassifyFailure(f"--keep {', '.join(sorted(clash))}: already an output column")
    if options.source != "-" and options.engine == "local" and not Path(options.source).is_file():
        raise ClassifyFailure(f"no such input file: {options.source}")
    if options.source == "-" and options.engine == "ray":
        raise ClassifyFailure("--engine ray reads files (local or remote paths), not stdin")
    if "://" in spec.target:
        raise ClassifyFailure("the output must be a local or mounted path, not a URI")
    if spec.folder and spec.path.exists() and not spec.path.is_dir():
        raise ClassifyFailure(f"{spec.target} is a file, not a folder for part files")
    try:
        thresholds = (
            load_thresholds(config.routing.thresholds_file, config)
            if config.routing.thresholds_file
            else {}
        )
    except ConfigError as exc:
        raise ClassifyFailure(str(exc)) from None
    found = fingerprint(config, thresholds, options.recorded(source_format, spec.fmt))
    skip, next_part, earlier, complete = _prepare_output(spec, found, options, console)
    routes = list(config.routes)
    summary = earlier or Summary(routes)
    if complete:
        console.print(f"{spec.target} is complete: nothing left to classify", markup=False)
        return _finish(
            summary, options, console, classified=0, elapsed=0.0, extra={}, resumed_after=skip
        )
    engine_name = "ray" if options.engine == "ray" else "local"
    if not spec.stdout:
        write_manifest(spec, Manifest(found, engine_name))
    if options.engine == "ray":
        from chatroute.cli.classify_ray import run_ray

        started = time.perf_counter()
        try:
            classified, extra = run_ray(config, options, source_format, spec, summary, console)
        except KeyboardInterrupt:
            console.print(
                f"interrupted; rerun the same command to classify into {spec.target} again "
                "(a Ray run starts over)",
                markup=False,
            )
            raise
        elapsed = time.perf_counter() - started
    else:
        classified, elapsed, extra = _run_local(
            config, options, source_format, spec, summary, console, skip, next_part
        )
    if not spec.stdout:
        write_manifest(spec, Manifest(found, engine_name, complete=True))
    return _finish(
        summary,
        options,
        console,
        classified=classified,
        elapsed=elapsed,
        extra=extra,
        resumed_after=skip,
    )


def _open_reader(options: ClassifyOptions, source_format: str) -> Reader:
    from chatroute.cli.classify_read import open_input

    try:
        return open_input(options.source, source_format, options.fields)
    except InputError as exc:
        raise ClassifyFailure(str(exc)) from None
    except OSError as exc:
        raise ClassifyFailure(f"cannot read {options.source}: {exc.strerror or exc}") from None


def _run_local(
    config: ChatrouteConfig,
    options: ClassifyOptions,
    source_format: str,
    spec: OutputSpec,
    summary: Summary,
    console: Console,
    skip: int,
    next_part: int,
) -> tuple[int, float, dict[str, Any]]:
    from chatroute.cli.classify_local import classify_batches
    from chatroute.engine import build_engine

    reader = _open_reader(options, source_format)
    scoring = scoring_mode(config)
    layout = Layout.of(reader, list(config.routes), with_scores=options.scores)
    run = _Run(summary, reader.where, console, options.max_bad, reached=skip)
    bar = _progress(console, options.progress)
    task = bar.add_task("classify", total=reader.total, inputs=0)
    writer = open_writer(spec, layout, next_part=next_part)
    interrupted = True

    def on_batch(batch: RowBatch, results: list[Result]) -> None:
        writer.write(batch, results)
        summary.add_columns(
            (r.route for r in results), (r.score for r in results), (r.is_default for r in results)
        )
        run.written += len(results)
        run.report_bad(batch.bad)
        run.reached = batch.last
        bar.update(task, completed=batch.position, inputs=run.written)

    async def work() -> None:
        engine = build_engine(config)
        try:
            await engine.warm()  # the model and the profile index, before the clock starts
            run.started = time.perf_counter()
            batches = reader.batches(options.batch_size, skip)
            await classify_batches(
                engine, batches, on_batch, scoring=scoring, with_scores=options.scores
            )
        finally:
            await engine.aclose()

    try:
        with bar:
            asyncio.run(work())
        interrupted = False
    except InputError as exc:
        raise ClassifyFailure(str(exc)) from None
    except KeyboardInterrupt:
        _interrupted(console, spec, run)
        raise
    finally:
        try:
            writer.close()
        finally:
            reader.close()
        if interrupted and not spec.stdout and spec.fmt == "parquet" and not spec.folder:
            spec.path.with_name(spec.path.name + ".inprogress").unlink(missing_ok=True)
    return run.written, time.perf_counter() - run.started, {}


def _interrupted(console: Console, spec: OutputSpec, run: _Run) -> None:
    if spec.stdout:
        console.print(
            f"interrupted after {run.written:,} inputs (through row {run.reached}); output "
            "went to stdout and cannot be resumed",
            markup=False,
        )
    elif spec.fmt == "parquet" and not spec.folder:
        console.print(
            f"interrupted after {run.written:,} inputs; a single Parquet file cannot be "
            "resumed: rerun to start over, or write to a folder (-o DIR/) to resume",
            markup=False,
        )
    else:
        console.print(
            f"interrupted after {run.written:,} inputs (through row {run.reached}); rerun the "
            f"same command to resume where {spec.target} stops",
            markup=False,
        )
