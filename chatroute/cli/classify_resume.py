"""The fingerprint an output of `chatroute classify` records, and whether a rerun may resume."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatroute.cli.classify_write import OutputSpec
from chatroute.config import ChatrouteConfig

__all__ = [
    "Manifest",
    "differences",
    "fingerprint",
    "manifest_path",
    "read_manifest",
    "remove_output",
    "scoring_mode",
    "write_manifest",
]

_VERSION = 1


def scoring_mode(config: ChatrouteConfig) -> str:
    """The router's scoring mode: `routing.scoring` when the config has it, else top_k."""
    return str(getattr(config.routing, "scoring", None) or "top_k")


def _digest(value: Any) -> str:
    raw = json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def fingerprint(
    config: ChatrouteConfig,
    route_thresholds: Mapping[str, float],
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """What decides an output's rows: the routes' utterances, the routing settings and
    thresholds, the model, the scoring mode, and the run's input and column options."""
    routing = config.routing
    return {
        "routes": {name: _digest(route.utterances) for name, route in config.routes.items()},
        "default_route": routing.default_route,
        "top_k": routing.top_k,
        "aggregation": routing.aggregation,
        "threshold": routing.score_threshold,
        "route_thresholds": dict(sorted(route_thresholds.items())),
        "model": config.embedder.model,
        "scoring": scoring_mode(config),
        **options,
    }


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What changed between two fingerprints, one readable line per change."""
    changes: list[str] = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if key == "routes" and isinstance(before, dict) and isinstance(after, dict):
            for name in sorted(set(before) | set(after)):
                if name not in before:
                    changes.append(f"route '{name}' added")
                elif name not in after:
                    changes.append(f"route '{name}' removed")
                elif before[name] != after[name]:
                    changes.append(f"route '{name}': utterances changed")
        elif key == "route_thresholds" and isinstance(before, dict) and isinstance(after, dict):
            for name in sorted(set(before) | set(after)):
                if before.get(name) != after.get(name):
                    changes.append(
                        f"threshold of route '{name}': {before.get(name)} -> {after.get(name)}"
                    )
        else:
            changes.append(f"{key}: {before!r} -> {after!r}")
    return changes


@dataclass
class Manifest:
    """The record beside an output: its fingerprint, engine, and whether it is complete."""

    fingerprint: dict[str, Any]
    engine: str
    complete: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {
                "chatroute_classify": _VERSION,
                "engine": self.engine,
                "complete": self.complete,
                "fingerprint": self.fingerprint,
            },
            indent=2,
            ensure_ascii=False,
        )


def manifest_path(spec: OutputSpec) -> Path:
    """`_classify.json` inside a folder output, `<file>.classify.json` beside a file."""
    if spec.folder:
        return spec.path / "_classify.json"
    return spec.path.with_name(spec.path.name + ".classify.json")


def read_manifest(spec: OutputSpec) -> Manifest | None:
    """The output's manifest; None when there is none or it is not one of ours."""
    try:
        data = json.loads(manifest_path(spec).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("chatroute_classify") != _VERSION:
        return None
    found = data.get("fingerprint")
    if not isinstance(found, dict):
        return None
    return Manifest(found, str(data.get("engine", "local")), bool(data.get("complete")))


def write_manifest(spec: OutputSpec, manifest: Manifest) -> None:
    """Write the manifest atomically (a crash leaves the old one or the new one)."""
    path = manifest_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(manifest.to_json() + "\n", encoding="utf-8")
    os.replace(temporary, path)


def remove_output(spec: OutputSpec) -> None:
    """Delete an output and its manifest (for --overwrite): a folder keeps whatever is not
    a data file of the output's format."""
    manifest_path(spec).unlink(missing_ok=True)
    if spec.folder:
        for path in [*spec.parts(), *spec.path.glob(".*.inprogress")]:
            path.unlink()
    else:
        spec.path.unlink(missing_ok=True)
        spec.path.with_name(spec.path.name + ".inprogress").unlink(missing_ok=True)
