"""Whether the service traces with OpenTelemetry: the standard `OTEL_*` variables decide."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatroute.otel import OTelLayer

__all__ = ["load_otel", "otel_requested"]

logger = logging.getLogger("chatroute.server")

_TRUE = ("true", "1", "yes", "on")


def otel_requested(environ: Mapping[str, str]) -> bool:
    """Tracing is asked for: `OTEL_TRACES_EXPORTER` names an exporter other than `none`, or
    an OTLP endpoint is set; never when `OTEL_SDK_DISABLED` is true."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def load_otel(environ: Mapping[str, str], tracer_provider: object | None) -> OTelLayer | None:
    """The tracing layer: on `tracer_provider` when given (yours to shut down), else on one
    made from the environment when it asks for tracing; None when tracing is off or the
    `chatroute[otel]` extra is not installed (said in the log)."""
    if tracer_provider is None and not otel_requested(environ):
        return None
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return None
    try:
        from chatroute.otel import OTelLayer, tracer_provider_from_environment
    except ImportError as exc:
        logger.warning(
            "OpenTelemetry tracing was asked for but is not installed (%s): "
            "install chatroute[otel]; tracing is off",
            exc.name,
        )
        return None
    if tracer_provider is not None:
        from opentelemetry.trace import TracerProvider

        if not isinstance(tracer_provider, TracerProvider):
            raise TypeError(f"tracer_provider must be a TracerProvider, got {tracer_provider!r}")
        return OTelLayer(tracer_provider, owned=False)
    made = tracer_provider_from_environment(environ)
    if made is None:
        logger.warning("no OpenTelemetry trace exporter could be loaded: tracing is off")
        return None
    exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp")
    logger.info("OpenTelemetry tracing on (exporter %s)", exporter)
    return OTelLayer(made, owned=True)
