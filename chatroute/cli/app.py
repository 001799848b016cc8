"""The `chatroute` command line: serve, reload, check, route, classify, fit and index build."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from chatroute import checks
from chatroute.chat.types import ChatMessage, ChatRole
from chatroute.cli.errors import UserErrorGroup
from chatroute.config import ChatrouteConfig

if TYPE_CHECKING:
    from chatroute.cli.classify import BadLine
    from chatroute.engine import Engine
    from chatroute.index import ProfileIndex

__all__ = ["app", "main"]

T = TypeVar("T")

app = typer.Typer(
    name="chatroute",
    help="Semantic routing and failover gateway for OpenAI-compatible LLM APIs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=UserErrorGroup,  # a user's error: one line and exit 2, never a traceback
)
index_app = typer.Typer(help="Build and manage the persisted profile index.", no_args_is_help=True)
app.add_typer(index_app, name="index")


class _Format(str, Enum):
    jsonl = "jsonl"
    csv = "csv"
    parquet = "parquet"


class _Engine(str, Enum):
    local = "local"
    ray = "ray"


def _console() -> Console:
    return Console(stderr=True, soft_wrap=True, highlight=False)


def note(message: str) -> None:
    """Print a plain line on stderr (never wrapped, never styled)."""
    _console().print(message, markup=False)


ConfigOption = Annotated[
    Path,
    typer.Option("--config", "-c", help="The YAML config file.", show_default=False),
]


def _fail(message: str, code: int = 2) -> typer.Exit:
    _console().print(f"[bold red]error:[/] {escape(message)}")
    return typer.Exit(code)


def _config(path: Path) -> ChatrouteConfig:
    """The config, checked as every command needs it (files, folders, model)."""
    return checks.load_checked(path)


def _run_engine(config: ChatrouteConfig, work: Callable[[Engine], Awaitable[T]]) -> T:
    """Build the engine, run `work(engine)` on a fresh event loop, close the engine."""
    from chatroute.engine import build_engine

    async def runner() -> T:
        engine = build_engine(config)
        try:
            await engine.prepare()
            return await work(engine)
        finally:
            await engine.aclose()

    return asyncio.run(runner())


@app.command()
def serve(
    config: ConfigOption,
    host: Annotated[
        str | None, typer.Option(help="Interface to bind (config: server.host).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (config: server.port).")] = None,
) -> None:
    """Run the HTTP service (OpenAI-compatible /v1/chat/completions, /v1/route, /v1/classify)."""
    settings = _config(config)  # a config error is reported before the server stack is imported
    from chatroute.server import create_app
    from chatroute.server.connection import http_protocol
    from chatroute.server.request_log import configure_logging, uvicorn_log_config
    from chatroute.server.startup import run_server

    log_format = settings.server.log_format
    configure_logging(settings.server.log_level, log_format)
    _quiet_model_loading()
    proxies = settings.server.forwarded_allow_ips
    logging_options = {} if log_format == "text" else {"log_config": uvicorn_log_config(log_format)}
    run_server(
        create_app(
            settings,
            embedder=checks.load_embedder(settings, source=str(config)),
            config_path=config,  # live reload: SIGHUP, POST /admin/reload
        ),
        **logging_options,
        host=host or settings.server.host,
        port=port if port is not None else settings.server.port,
        log_level=settings.server.log_level,
        # uvicorn's httptools protocol, with a bounded request head (size and time).
        http=http_protocol(settings.server.head_timeout),
        server_header=False,  # no `server: uvicorn` on every answer
        # The service logs one line per request itself (with its route, provider and
        # tokens): uvicorn's access log would repeat it.
        access_log=False,
        timeout_graceful_shutdown=10,
        # Longer than the usual 60 s idle timeout of proxies and load balancers in front,
        # so they, not the service, close idle keep-alive connections (no reset races).
        timeout_keep_alive=75,
        # Forwarded headers only from the proxies the config names (uvicorn would trust
        # 127.0.0.1 by default and wrap every request in its middleware to check).
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies,
    )


def _quiet_model_loading() -> None:
    """No progress bars while the service loads its model: a service's stderr is its log
    (one line per event, JSON lines with `log_format: json`)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


@app.command()
def reload(
    url: Annotated[
        str,
        typer.Option(help="The running service (http://host:port).", envvar="CHATROUTE_URL"),
    ],
    admin_key: Annotated[
        str,
        typer.Option(help="The service's admin key.", envvar="CHATROUTE_ADMIN_KEY"),
    ],
    timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds to wait for the reload to finish.")
    ] = 300.0,
) -> None:
    """Reload a running service's config file (POST /admin/reload); print its report as JSON."""
    from chatroute.cli.admin import reload_remote
    from chatroute.cli.remote import RemoteError

    try:
        report = reload_remote(url, admin_key, timeout=timeout)
    except RemoteError as exc:
        raise _fail(str(exc)) from None
    typer.echo(json.dumps(report, indent=2))


@app.command()
def route(
    texts: Annotated[
        list[str],
        typer.Argument(
            help="The user messages to route; '-' reads them from stdin, one per line.",
            show_default=False,
        ),
    ],
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="The YAML config file (loads the model here).",
            show_default=False,
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="Ask a running service at this URL (POST /v1/route) instead of loading the model.",
            envvar="CHATROUTE_URL",
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="The service's API key (with --url).", envvar="CHATROUTE_API_KEY"),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds to wait for each answer (with --url).")
    ] = 30.0,
) -> None:
    """Print the route decision for each TEXT as JSON (no provider is called).

    One TEXT prints its decision as indented JSON; several, or '-', print one JSON object
    per line with the text as "input".
    """
    lines = _route_texts(texts)
    if (config is None) == (url is None):
        raise _fail("give --config FILE (load the model here) or --url URL (ask a service)")
    if url is not None:
        from chatroute.cli.remote import RemoteError, route_remote

        try:
            asked = route_remote(url, lines, api_key=api_key, request_timeout=timeout)
            results = asyncio.run(asked)
        except RemoteError as exc:
            raise _fail(str(exc)) from None
    else:
        assert config is not None
        settings = _config(config)

        async def work(engine: Engine) -> list[dict[str, object]]:
            gate = asyncio.Semaphore(256)  # batches well, and never fills the embedder's queue

            async def one(text: str) -> dict[str, object]:
                async with gate:
                    decision = await engine.decide([ChatMessage(ChatRole.USER, text)])
                return engine.describe(decision, matches=True)

            return list(await asyncio.gather(*(one(text) for text in lines)))

        results = _run_engine(settings, work) if lines else []
    if len(texts) == 1 and texts[0] != "-":
        typer.echo(json.dumps(results[0], indent=2, ensure_ascii=False))
        return
    for text, result in zip(lines, results, strict=True):
        typer.echo(json.dumps({"input": text, **result}, ensure_ascii=False))


def _route_texts(texts: list[str]) -> list[str]:
    """The texts to route: each argument, '-' replaced by stdin's non-blank lines."""
    lines: list[str] = []
    for text in texts:
        if text == "-":
            lines.extend(line.rstrip("\r\n") for line in sys.stdin if line.strip())
        else:
            lines.append(text)
    return lines


@app.command()
def classify(
    config: ConfigOption,
    source: Annotated[
        str,
        typer.Argument(
            help="Input file ('-' for stdin): JSONL (strings, {'input'} or {'messages'} "
            "lines), CSV or Parquet; with --engine ray also a folder or a remote path.",
            show_default=False,
        ),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            help="A file, a folder of part files (a name ending in '/'), or '-' for stdout.",
            show_default=False,
        ),
    ],
    input_format: Annotated[
        _Format | None, typer.Option("--format", help="Input format (default: by extension).")
    ] = None,
    output_format: Annotated[
        _Format | None,
        typer.Option(help="Output format (default: by extension; Parquet for a folder)."),
    ] = None,
    text_field: Annotated[
        str | None, typer.Option(help="Column with the text to route (default: input).")
    ] = None,
    messages_field: Annotated[
        str | None,
        typer.Option(help="Column with OpenAI-shaped messages (default: messages)."),
    ] = None,
    id_field: Annotated[
        str | None, typer.Option(help="Column carried as the row's id (default: id).")
    ] = None,
    keep: Annotated[
        str | None, typer.Option(help="Comma-separated input columns to carry to the output.")
    ] = None,
    scores: Annotated[bool, typer.Option(help="Also write every route's score.")] = False,
    batch_size: Annotated[int, typer.Option(min=1, help="Inputs per routing batch.")] = 256,
    part_rows: Annotated[
        int, typer.Option(min=1, help="Rows per part file of a folder output.")
    ] = 20_000,
    summary: Annotated[
        Path | None, typer.Option(help="Also write the per-route summary as JSON here.")
    ] = None,
    max_bad: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Stop (exit 1) past this many malformed rows; at most that many exit 0. "
            "Default: read everything, exit 1 if any row was malformed.",
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing output instead of resuming it.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    engine: Annotated[
        _Engine, typer.Option(help="local: this process; ray: Ray Data actors.")
    ] = _Engine.local,
    ray_address: Annotated[
        str | None,
        typer.Option(help="Ray cluster to connect to (default: a local instance)."),
    ] = None,
    num_actors: Annotated[int, typer.Option(min=1, help="Ray: router actors.")] = 1,
    gpus_per_actor: Annotated[
        float, typer.Option(min=0.0, help="Ray: GPUs per actor (the model runs in fp16).")
    ] = 0.0,
    cpus_per_actor: Annotated[
        float | None,
        typer.Option(min=0.0, help="Ray: CPUs per actor (local instance: its CPUs / actors)."),
    ] = None,
) -> None:
    """Classify every row of SOURCE into OUTPUT; a rerun resumes where OUTPUT stops."""
    from chatroute.cli.classify_command import ClassifyFailure, ClassifyOptions, run_classify
    from chatroute.cli.classify_read import Fields

    settings = _config(config)
    if source != "-" and engine is _Engine.local:
        read = checks.input_file("SOURCE", source)
        if output != "-" and Path(output).is_file() and Path(output).samefile(read):
            raise checks.PathError(
                "--output", Path(output), "is the input file; write the output to another file"
            )
    options = ClassifyOptions(
        source=source,
        output=output,
        input_format=input_format.value if input_format else None,
        output_format=output_format.value if output_format else None,
        fields=Fields(
            text=text_field,
            messages=messages_field,
            id=id_field,
            keep=tuple(name.strip() for name in (keep or "").split(",") if name.strip()),
        ),
        scores=scores,
        batch_size=batch_size,
        part_rows=part_rows,
        summary_file=summary,
        max_bad=max_bad,
        overwrite=overwrite,
        progress=progress,
        engine=engine.value,
        ray_address=ray_address,
        num_actors=num_actors,
        gpus_per_actor=gpus_per_actor,
        cpus_per_actor=cpus_per_actor,
    )
    try:
        code = run_classify(settings, options, _console())
    except ClassifyFailure as exc:
        raise _fail(exc.message, exc.code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if code:
        raise typer.Exit(code)


@app.command()
def fit(
    config: ConfigOption,
    labelled: Annotated[
        Path, typer.Argument(help="JSONL lines {'input' or 'messages', 'route': name or null}.")
    ],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Thresholds file to write (default: stdout)."),
    ] = None,
    no_route_share: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Weight of 'no route' examples in the fit.")
    ] = 0.5,
) -> None:
    """Fit per-route thresholds on labelled queries; point routing.thresholds_file at them."""
    from chatroute.cli.fit import fit_file, thresholds_document

    settings = checks.load_checked(config, thresholds_may_be_missing=True)  # fit writes it
    checks.output_file("--output", output, not_same_as=checks.input_file("LABELLED", labelled))
    if not labelled.is_file():
        raise _fail(f"no such input file: {labelled}")

    def bad_line(bad: BadLine) -> None:
        note(f"{labelled}:{bad.line}: skipped: {bad.reason}")

    async def work(engine: Engine) -> tuple[dict[str, object], str, list[str]]:
        result, notes = await fit_file(
            engine, labelled, no_route_share=no_route_share, on_bad_line=bad_line
        )
        return thresholds_document(engine, result), str(result.report), notes

    try:
        document, report, notes = _run_engine(settings, work)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    for warning in notes:
        note(f"warning: {warning}")
    note(report)
    chosen = document.get("oos_score")
    if chosen is not None and chosen != settings.routing.oos_score:
        note(f"the thresholds fit the out-of-scope score {chosen}: set routing.oos_score: {chosen}")
    text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        note(f"thresholds written to {output}")


@index_app.command("build")
def index_build(
    config: ConfigOption,
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to save into.")],
) -> None:
    """Embed every route utterance, train the scoring head, save both (reusing what is kept)."""
    from chatroute.index import ProfileIndex
    from chatroute.router.scoring import make_scoring

    settings = _config(config)
    checks.index_folder("--output", output)

    async def work(engine: Engine) -> ProfileIndex:
        scoring = make_scoring(settings.routing.scoring, oos_score=settings.routing.oos_score)
        return await ProfileIndex.load_or_build(
            output, engine.embedder, engine.profile_entries(), scoring=scoring
        )

    index = _run_engine(settings, work)
    note(f"profile index: {len(index)} utterances, dimension {index.dimension}, saved in {output}")
    scoring = settings.routing.scoring
    if index.head is not None:
        note(f"scoring {scoring}: head trained in {index.head.train_seconds:.2f} s")
    else:
        note(f"scoring {scoring}: nothing to train")


@app.command()
def check(
    config: ConfigOption,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe",
            help="Also call each provider's model listing (GET /models): reachable, key "
            "accepted, model served.",
        ),
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds each probe may take.", min=0.1, max=120)
    ] = 10.0,
    no_model: Annotated[
        bool,
        typer.Option(
            "--no-model", help="Do not load the embedding model (only check that it is found)."
        ),
    ] = False,
) -> None:
    """Run every check the other commands run before working, and show what the config sets up.

    The file (keys, values, URLs, headers, names), the files and folders it names, and the
    embedding model, loaded as `serve` loads it (`--no-model`: only found); with --probe,
    also each provider. Exits 2 for a config error, with one line per problem, and 1 when a
    probe fails; no chat request is sent (nothing is billed).
    """
    import os

    from rich.table import Table

    settings = _config(config)
    if not no_model:
        checks.check_model_loads(settings, source=str(config))
    env = os.environ
    console = Console(soft_wrap=True, highlight=False)
    providers = Table(title="providers", title_justify="left")
    for column in ("name", "type", "endpoint", "model", "key"):
        providers.add_column(column, overflow="fold")
    for name, provider in settings.providers.items():
        if provider.api_key_env is None:
            key = "none"
        elif env.get(provider.api_key_env):
            key = f"from {provider.api_key_env}"
        else:
            key = f"[yellow]{provider.api_key_env} not set[/]"
        endpoint = provider.resolved_base_url(env) or "(Anthropic's)"
        providers.add_row(
            escape(name),
            provider.type,
            escape(endpoint),
            escape(provider.resolved_model(env) or ""),
            key,
        )
    routes = Table(title="routes", title_justify="left")
    for column in ("route", "targets, in order", "utterances", "options"):
        routes.add_column(column, overflow="fold")
    default = settings.routing.default_route
    for name, spec in settings.routes.items():
        options = ", ".join(
            f"{k}={v}" for k, v in spec.options.model_dump(exclude_none=True).items()
        )
        label = f"{name} (default)" if name == default else name
        routes.add_row(
            escape(label),
            escape(" → ".join(spec.targets)),
            str(len(spec.utterances)),
            escape(options),
        )
    console.print(providers)
    console.print(routes)
    shared = settings.shared_state.redis_url_env
    if shared is None:
        console.print("breakers: kept by each replica (no shared_state)")
    elif env.get(shared):
        console.print(f"breakers: shared through Redis ({shared} is set)")
    else:
        console.print(f"breakers: kept by each replica ([yellow]{shared} not set[/])")
    console.print(f"config ok: {config}")
    if probe and not asyncio.run(_probe(settings, env, timeout, console)):
        raise typer.Exit(1)


async def _probe(
    settings: ChatrouteConfig, env: Mapping[str, str], limit: float, console: Console
) -> bool:
    """List each provider's models; report and return whether every provider answered."""
    import time

    from chatroute.engine import build_provider

    async def one(name: str) -> tuple[str, bool, str]:
        client, model, _ = build_provider(name, settings.providers[name], env)
        started = time.perf_counter()
        try:
            lister = getattr(client, "list_models", None)
            if lister is None:
                return name, True, "no model listing to probe"
            async with asyncio.timeout(limit):
                models = await lister()
        except TimeoutError:
            return name, False, f"no answer within {limit:g} s"
        except Exception as exc:
            return name, False, str(exc)
        finally:
            await client.aclose()
        took = (time.perf_counter() - started) * 1000
        listed = "lists" if model in models else "[yellow]does not list[/]"
        return name, True, f"ok in {took:.0f} ms, {len(models)} models; {listed} {escape(model)}"

    results = await asyncio.gather(*(one(name) for name in settings.providers))
    for name, ok, detail in results:
        mark = "[green]ok[/]" if ok else "[bold red]failed[/]"
        shown = detail if ok else escape(detail)
        console.print(f"probe {escape(name)}: {mark} - {shown}")
    return all(ok for _, ok, _ in results)


def main() -> None:
    """Entry point of the `chatroute` script."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
