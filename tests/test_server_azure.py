"""An Azure OpenAI-style provider (api-key header, api-version query) behind the service."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import openai
import pytest

from chatroute.chat import EmbeddingGenerator
from chatroute.config import ConfigError, parse_config
from chatroute.server import create_app
from tests.fakes import FakeUpstream, Ok

SECRET = "azure-key-0123456789abcdef"


def _config(up: FakeUpstream) -> dict[str, Any]:
    return {
        "routing": {"default_route": "general"},
        "providers": {
            "azure": {
                "base_url": f"{up.url}/openai/deployments/gpt-4o",
                "model": "gpt-4o",
                "api_key_env": "AZURE_OPENAI_API_KEY",
                "api_key_header": "api-key",
                "query": {"api-version": "2024-10-21"},
            }
        },
        "routes": {"general": {"utterances": ["hello"], "targets": ["azure"]}},
    }


def test_calls_carry_the_api_key_header_and_the_api_version(
    default_embedder: Callable[[], EmbeddingGenerator],
    serve_app: Callable[..., contextlib.AbstractContextManager[str]],
) -> None:
    with FakeUpstream(default=Ok("from azure")) as up:
        environ = {"AZURE_OPENAI_API_KEY": SECRET}
        config = parse_config(_config(up), environ=environ)
        app = create_app(config, api_keys=[], environ=environ, embedder=default_embedder())
        with serve_app(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            ask = [{"role": "user", "content": "hello"}]
            answer = client.chat.completions.create(model="general", messages=ask)
            stream = client.chat.completions.create(model="general", messages=ask, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            client.close()
    assert answer.choices[0].message.content == "from azure" and text == "from azure"
    assert len(up.requests) == 2
    for request in up.requests:
        assert request.path == "/openai/deployments/gpt-4o/chat/completions"
        assert request.query == "api-version=2024-10-21"
        assert request.headers["api-key"] == SECRET
        assert "authorization" not in request.headers


def test_the_config_keeps_keys_out_of_queries_and_anthropic_headers() -> None:
    fake = {"base_url": "http://127.0.0.1:1/v1", "model": "m"}
    base = {
        "routing": {"default_route": "r"},
        "routes": {"r": {"utterances": ["hi"], "targets": ["p"]}},
    }
    with pytest.raises(ConfigError, match=r"providers\.p\.query.*carries a secret"):
        parse_config({**base, "providers": {"p": {**fake, "query": {"api-key": "k"}}}})
    claude = {"type": "anthropic", "model": "m", "api_key_header": "api-key"}
    with pytest.raises(ConfigError, match=r"providers\.p\.api_key_header"):
        parse_config({**base, "providers": {"p": claude}})
