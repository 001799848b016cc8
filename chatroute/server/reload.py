"""Live reload of the config file: a new engine built aside, swapped in, the old one drained."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from chatroute.config import ChatrouteConfig, ConfigError, load_config
from chatroute.engine import Engine, build_engine
from chatroute.server.errors import APIError
from chatroute.server.service import Service
from chatroute.server.startup import scoring_of

__all__ = [
    "ADMIN_RELOAD_PATH",
    "ReloadBusy",
    "ReloadFailed",
    "ReloadMiddleware",
    "ReloadResult",
    "Reloader",
    "admin_key",
    "install_reload",
    "watch_sighup",
]

logger = logging.getLogger("chatroute.server")

ADMIN_RELOAD_PATH = "/admin/reload"


class ReloadBusy(Exception):
    """A reload is already running; this one was refused."""


class ReloadFailed(Exception):
    """The new config could not be loaded or built; the old one keeps serving.

    `problems` lists (where, what) pairs; `status` is the HTTP status for the admin API.
    """

    def __init__(self, message: str, problems: list[tuple[str, str]], status: int = 422) -> None:
        super().__init__(message)
        self.problems = problems
        self.status = status


@dataclass(frozen=True)
class ReloadResult:
    """What a reload did."""

    routes: list[str]
    embedder: str  # "reused" or "rebuilt"
    seconds: float
    draining: int  # requests still running on the old config when it was swapped out
    notes: list[str] = field(default_factory=list)
    scoring: str | None = None  # the scoring mode the new config decides with
    training_seconds: float | None = None  # its training (None: a mode that does not train)

    def as_json(self) -> dict[str, Any]:
        return {
            "status": "reloaded",
            "routes": self.routes,
            "embedder": self.embedder,
            "seconds": round(self.seconds, 3),
            "draining": self.draining,
            "notes": self.notes,
            "scoring": self.scoring,
            "training_seconds": (
                None if self.training_seconds is None else round(self.training_seconds, 3)
            ),
        }


@dataclass(eq=False)
class _Generation:
    """The service one config runs on and the requests that started while it was current."""

    service: Service
    owned: bool
    shared_embedder: bool = False  # the next generation reuses this one's embedder
    active: int = 0
    retired: bool = False
    drained: asyncio.Event = field(default_factory=asyncio.Event)

    def leave(self) -> None:
        self.active -= 1
        if self.retired and self.active == 0:
            self.drained.set()


class Reloader:
    """Reloads the service's config file: builds and warms a new engine off the serving
    path (the embedder is reused unless its settings changed), swaps the app's `Service`
    in one assignment, and closes the old engine once the requests that started on it are
    done. One reload at a time: another one meanwhile is refused (`ReloadBusy`).

    `on_swap(old, new)` runs at the swap (the app rewires its metrics there).
    """

    def __init__(
        self,
        app: FastAPI,
        path: str | os.PathLike[str],
        service: Service,
        *,
        owned: bool,
        environ: Mapping[str, str],
        on_swap: Callable[[Service, Service], None] | None = None,
    ) -> None:
        self.app = app
        self.path = Path(path)
        self.environ = environ
        self.on_swap = on_swap
        self.current = _Generation(service, owned)
        self._lock = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        self._retiring: list[_Generation] = []

    @property
    def busy(self) -> bool:
        """Whether a reload is running."""
        return self._lock.locked()

    async def reload(self) -> ReloadResult:
        """Reload the config file; `ReloadBusy` during another reload, `ReloadFailed` (the
        old config keeps serving) when the new one is invalid or cannot be built."""
        if self._lock.locked():
            raise ReloadBusy("a reload is already running: try again when it has finished")
        async with self._lock:
            return await self._reload()

    async def _reload(self) -> ReloadResult:
        began = time.perf_counter()
        old = self.current
        try:
            config = await asyncio.to_thread(load_config, self.path, environ=self.environ)
        except ConfigError as exc:
            raise ReloadFailed(f"{self.path}: the config is not valid", exc.problems) from None
        old_config = old.service.config
        same_embedder = config.embedder == old_config.embedder
        notes: list[str] = []
        if not same_embedder:
            notes.append(
                f"the embedder changed ({old_config.embedder.model} -> {config.embedder.model}):"
                " the model, the index and the scoring heads are all rebuilt"
            )
            logger.info("reload: %s", notes[-1])
        if config.server != old_config.server:
            notes.append("server settings (listen address, limits, keys) apply after a restart")
        if config.shared_state != old_config.shared_state:
            notes.append("shared_state settings apply after a restart")
        old_engine = old.service.engine
        engine = await self._build(config, old_engine if same_embedder else None)
        if engine.breakers is not old_engine.breakers and config.shared_state.redis_url_env:
            notes.append("breaker settings changed: breaker state is shared after a restart")
        for secret in engine.secrets:
            old.service.redact.add(secret)
        service = dataclasses.replace(old.service, engine=engine, ready=True)
        fresh = _Generation(service, owned=True)
        old.shared_embedder = same_embedder
        # The swap: requests that read the app's service from now on run on the new one.
        if self.on_swap is not None:
            self.on_swap(old.service, service)
        self.app.state.service = service
        self.current = fresh
        old.retired = True
        draining = max(0, old.active)
        if old.active <= 0:
            old.drained.set()
        self._retiring.append(old)
        task = asyncio.create_task(self._retire(old))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        seconds = time.perf_counter() - began
        scoring, training = scoring_of(engine)
        result = ReloadResult(
            list(engine.routes),
            "reused" if same_embedder else "rebuilt",
            seconds,
            draining,
            notes,
            scoring,
            training,
        )
        logger.info(
            "config reloaded from %s in %.2f s: %d routes, embedder %s, scoring %s (trained in "
            "%s), %d request(s) finish on the old config%s",
            self.path,
            seconds,
            len(result.routes),
            result.embedder,
            scoring,
            "-" if training is None else f"{training:.2f} s",
            draining,
            "".join(f"; {note}" for note in notes),
        )
        return result

    async def _build(self, config: ChatrouteConfig, reuse: Engine | None) -> Engine:
        embedder = reuse.embedder if reuse is not None else None
        breakers = self.current.service.engine.breakers
        try:
            engine = await asyncio.to_thread(
                build_engine, config, embedder=embedder, environ=self.environ, breakers=breakers
            )
        except ConfigError as exc:
            raise ReloadFailed(f"{self.path}: the config is not valid", exc.problems) from None
        except Exception as exc:
            raise ReloadFailed(
                f"{self.path}: the engine could not be built",
                [("", f"{type(exc).__name__}: {exc}")],
            ) from None
        try:
            await engine.warm()
        except Exception as exc:
            await _close(engine, keep_embedder=reuse is not None)
            raise ReloadFailed(
                f"{self.path}: the model or the index could not be loaded",
                [("embedder", f"{type(exc).__name__}: {exc}")],
            ) from None
        return engine

    async def _retire(self, old: _Generation) -> None:
        await old.drained.wait()
        self._retiring.remove(old)
        if old.owned:
            await _close(old.service.engine, keep_embedder=old.shared_embedder)
        logger.info("the previous config's engine is closed (its requests are done)")

    async def aclose(self) -> None:
        """At shutdown (no request runs any more): close the retired engines now, and the
        current one when the app owns it."""
        for generation in self._retiring:
            generation.drained.set()
        await asyncio.gather(*self._closing, return_exceptions=True)
        current = self.current
        if current.owned:
            await _close(current.service.engine, keep_embedder=False)


async def _close(engine: Engine, *, keep_embedder: bool) -> None:
    """Close an engine; its providers only when its embedder lives on in a newer engine."""
    if not keep_embedder:
        try:
            await engine.aclose()
        except Exception as exc:
            logger.warning("closing the old engine failed: %s", type(exc).__name__)
        return
    for provider in engine.providers.values():
        try:
            await provider.aclose()
        except Exception as exc:
            logger.warning("closing %s failed: %s", type(provider).__name__, type(exc).__name__)


class ReloadMiddleware:
    """Counts the requests running on each config, so the old engine closes after them."""

    def __init__(self, app: ASGIApp, reloader: Callable[[], Reloader | None]) -> None:
        self.app = app
        self.reloader = reloader

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        reloader = self.reloader() if scope["type"] == "http" else None
        if reloader is None or scope.get("path", "").startswith("/admin/"):
            await self.app(scope, receive, send)
            return
        generation = reloader.current
        generation.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            generation.leave()


def admin_key(config: ChatrouteConfig, environ: Mapping[str, str]) -> str | None:
    """The admin key (from the variable `server.admin_key_env` names); None: admin API off."""
    name = config.server.admin_key_env
    key = environ.get(name, "").strip() if name else ""
    return key or None


def install_reload(app: FastAPI, key: str | None) -> None:
    """`POST /admin/reload` (with `Authorization: Bearer <admin key>`); 404 without a key."""

    @app.post(ADMIN_RELOAD_PATH, tags=["admin"], include_in_schema=key is not None)
    async def reload_config(request: Request) -> JSONResponse:
        """Reload the config file; 422 with the problems of a bad one, 409 during a reload."""
        reloader: Reloader | None = getattr(request.app.state, "reloader", None)
        if key is None or reloader is None:
            raise APIError(404, "the admin API is off: set an admin key", code="not_found")
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise APIError(
                401, "a valid admin key is required", type="authentication_error", code="bad_key"
            )
        try:
            result = await reloader.reload()
        except ReloadBusy as exc:
            raise APIError(409, str(exc), code="reload_running") from None
        except ReloadFailed as exc:
            details = "; ".join(f"{where or 'config'}: {what}" for where, what in exc.problems)
            logger.error("reload refused, the old config keeps serving: %s: %s", exc, details)
            return JSONResponse(
                {
                    "error": {
                        "message": f"{exc}; the old config keeps serving: {details}",
                        "type": "invalid_request_error",
                        "code": "invalid_config",
                        "problems": [{"where": w, "problem": p} for w, p in exc.problems],
                    }
                },
                status_code=exc.status,
            )
        return JSONResponse(result.as_json())


def watch_sighup(reloader: Reloader) -> Callable[[], None]:
    """Reload on SIGHUP (on the serving loop, in the main thread); returns the undo."""
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            await reloader.reload()
        except ReloadBusy as exc:
            logger.warning("SIGHUP ignored: %s", exc)
        except ReloadFailed as exc:
            details = "; ".join(f"{where or 'config'}: {what}" for where, what in exc.problems)
            logger.error("reload refused, the old config keeps serving: %s: %s", exc, details)
        except Exception:
            logger.exception("reload failed, the old config keeps serving")

    def on_signal() -> None:
        task = loop.create_task(reload())
        running.add(task)
        task.add_done_callback(running.discard)

    try:
        loop.add_signal_handler(signal.SIGHUP, on_signal)
    except (ValueError, RuntimeError, NotImplementedError, AttributeError):
        return lambda: None  # not the main thread, or no SIGHUP on this platform

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return undo
