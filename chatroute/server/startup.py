"""The start-up summary (what runs: model, scoring, routes, providers) and "ready" once bound."""

from __future__ import annotations

import logging
import socket
import urllib.parse
from collections.abc import Mapping
from typing import Any

import uvicorn

from chatroute import __version__
from chatroute.engine import Engine

__all__ = ["ReadyServer", "log_startup", "run_server", "startup_summary"]

logger = logging.getLogger("chatroute.server")


def _endpoint(url: str | None) -> str | None:
    """A base URL without credentials, query or fragment (those may carry secrets)."""
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        port = ""
    return urllib.parse.urlunsplit((parts.scheme, host + port, parts.path, "", ""))


def startup_summary(
    engine: Engine, *, auth: bool, shared_state: bool, environ: Mapping[str, str]
) -> dict[str, Any]:
    """What the service runs, as data: version, the embedder (model, device, dtype), the
    scoring mode and its training time, each route (utterances, failover order), each
    provider (endpoint, model, whether its key variable is set: never the key), and
    whether API keys are required and breaker state is shared."""
    from chatroute.providers.registry import provider_class

    config = engine.config
    embedder: Any = engine.embedder
    scoring, training_seconds = scoring_of(engine)
    providers: dict[str, Any] = {}
    for name, settings in config.providers.items():
        base_url = settings.resolved_base_url(environ)
        if base_url is None:
            try:
                base_url = provider_class(settings.type).default_base_url
            except Exception:  # an unknown type never gets this far; keep the summary
                base_url = None
        key_env = settings.api_key_env
        providers[name] = {
            "type": settings.type,
            "endpoint": _endpoint(base_url),
            "model": engine.provider_models.get(name),
            "key": "none" if key_env is None else ("set" if environ.get(key_env) else "unset"),
            "key_env": key_env,
        }
    return {
        "version": __version__,
        "embedder": {
            "model": getattr(embedder, "model", None) or config.embedder.model,
            "device": getattr(embedder, "device", None) or config.embedder.device,
            "dtype": getattr(embedder, "dtype", None) or config.embedder.dtype,
            "workers": getattr(embedder, "workers", None),
            "solo_threads": getattr(embedder, "solo_threads", None),
            "traced": getattr(embedder, "traced", None),
        },
        "policy": config.routing.policy,
        "scoring": scoring,
        "training_seconds": training_seconds,
        "default_route": config.routing.default_route,
        "routes": {
            name: {"utterances": len(route.utterances), "failover": list(route.targets)}
            for name, route in config.routes.items()
        },
        "providers": providers,
        "auth": auth,
        "shared_state": shared_state,
    }


def scoring_of(engine: Engine) -> tuple[str | None, float | None]:
    """The scoring mode the engine's router decides with, and how long its training took
    (None for a mode that does not train, or a router without modes)."""
    router: Any = engine.router
    return getattr(getattr(router, "scoring", None), "name", None), getattr(
        router, "training_seconds", None
    )


def log_startup(summary: Mapping[str, Any]) -> None:
    """Log the summary: one line on the whole, one per route and one per provider."""
    embedder = summary["embedder"]
    seconds = summary["training_seconds"]
    how = [embedder["dtype"]]
    if embedder.get("workers"):
        how.append(f"{embedder['workers']} model threads")
    if embedder.get("solo_threads"):
        how.append(f"a lone pass on {embedder['solo_threads']} threads")
    if embedder.get("traced"):
        how.append("packed passes traced")
    logger.info(
        "chatroute %s: embedder %s on %s (%s); %s routing, scoring %s (trained in %s); "
        "auth %s; shared state %s",
        summary["version"],
        embedder["model"],
        embedder["device"],
        ", ".join(how),
        summary["policy"],
        summary["scoring"],
        "-" if seconds is None else f"{seconds:.2f} s",
        "on" if summary["auth"] else "off (no API keys: /v1 is open)",
        "on" if summary["shared_state"] else "off",
        extra={"startup": dict(summary)},
    )
    for name, route in summary["routes"].items():
        default = " (default)" if name == summary["default_route"] else ""
        logger.info(
            "route %s%s: %d utterances, failover %s",
            name,
            default,
            route["utterances"],
            " -> ".join(route["failover"]),
        )
    for name, provider in summary["providers"].items():
        key = provider["key"]
        logger.info(
            "provider %s: %s %s at %s, %s",
            name,
            provider["type"],
            provider["model"],
            provider["endpoint"],
            "no API key configured"
            if key == "none"
            else f"API key {'set' if key == 'set' else 'NOT set'} ({provider['key_env']})",
        )


class ReadyServer(uvicorn.Server):
    """uvicorn's server that logs "ready" once its sockets are bound (after the app's
    start-up, which loads the model, and after the port accepts connections)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started or self.should_exit:
            return
        bound: list[str] = []
        for server in self.servers:
            for sock in server.sockets:
                name = sock.getsockname()
                bound.append(f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name))
        logger.info("ready: listening on %s", ", ".join(bound) or "the given sockets")


def run_server(app: Any, **options: Any) -> None:
    """Run `app` under uvicorn (options as `uvicorn.run` takes them) with `ReadyServer`."""
    ReadyServer(uvicorn.Config(app, **options)).run()
