"""Defaults that never hang: every provider and request is time-limited, as the example shows."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from chatroute.config import (
    ChatrouteConfig,
    ProviderTimeouts,
    ResilienceConfig,
    load_config,
    parse_config,
)
from tests.conftest import ServiceStack
from tests.fakes import Hang, Ok

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
EXAMPLE = Path(__file__).parent.parent / "examples" / "chatroute.yaml"
LIMITS = ("connect", "first_token", "stall")


def test_every_provider_and_request_has_a_limit_by_default() -> None:
    config = parse_config(
        {
            "routing": {"default_route": "general"},
            "providers": {"p": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}},
            "routes": {"general": {"utterances": ["hello"], "targets": ["p"]}},
        },
        environ={},
    )
    timeouts = config.providers["p"].timeouts
    for name in LIMITS:
        assert getattr(timeouts, name) is not None, name
    # The first token may take as long as a reasoning model thinks; a started stream that
    # goes quiet for longer than `stall` has stalled; the deadline bounds the whole request.
    assert timeouts.stall is not None and timeouts.first_token is not None
    assert timeouts.stall <= timeouts.first_token <= timeouts.read
    deadline = config.resilience.for_route(config.routes["general"]).deadline
    assert deadline is not None and deadline > timeouts.first_token


def test_null_still_switches_a_limit_off() -> None:
    data = {
        "routing": {"default_route": "general"},
        "resilience": {"deadline": None},
        "providers": {
            "p": {
                "base_url": "http://127.0.0.1:9/v1",
                "model": "m",
                "timeouts": {"first_token": None, "stall": None},
            }
        },
        "routes": {"general": {"utterances": ["hello"], "targets": ["p"]}},
    }
    config = parse_config(data, environ={})
    assert config.providers["p"].timeouts.first_token is None
    assert config.providers["p"].timeouts.stall is None
    assert config.resilience.deadline is None


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_show_the_defaults_they_run_with(path: Path) -> None:
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    defaults = ProviderTimeouts()
    for name, provider in raw["providers"].items():
        shown = provider.get("timeouts", {})
        for key in LIMITS:
            assert shown.get(key) == getattr(defaults, key), f"providers.{name}.timeouts.{key}"
    assert raw["resilience"]["deadline"] == ResilienceConfig().deadline
    # And without the lines that show them, the config means the same.
    bare = copy.deepcopy(raw)
    bare.pop("resilience")
    for provider in bare["providers"].values():
        for key in LIMITS:
            provider.get("timeouts", {}).pop(key, None)
    shown_config = load_config(path, environ={})
    bare_config = parse_config(bare, environ={})
    for name in raw["providers"]:
        assert bare_config.providers[name].timeouts == shown_config.providers[name].timeouts
    assert bare_config.resilience == shown_config.resilience


def _example_on(base_urls: dict[str, str], first_token: float) -> dict[str, Any]:
    """The example config with its providers pointed at fakes and a short first-token limit."""
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    for name, provider in data["providers"].items():
        for key in ("base_url_env", "model_env", "api_key_env"):
            provider.pop(key, None)
        provider["base_url"] = base_urls[name]
        provider["timeouts"]["first_token"] = first_token
    return dict(data)


@pytest.fixture(scope="module")
def example_stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
) -> Any:
    with service_stack(lambda urls: _example_on(urls, 0.3), ["local", "strong"]) as stack:
        yield stack


def test_the_example_config_fails_a_silent_upstream_over_after_the_first_token_limit(
    example_stack: ServiceStack,
) -> None:
    stack = example_stack
    stack.reset()
    config: ChatrouteConfig = stack.service.engine.config
    assert config.routes["code"].targets == ["strong", "local"]
    stack.upstreams["strong"].default = Hang()  # accepts the request, then says nothing
    stack.upstreams["local"].default = Ok("answered by the fallback")
    raw = stack.client.chat.completions.with_raw_response.create(
        model="code",
        messages=[{"role": "user", "content": "fix this bug in my python code"}],
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == "answered by the fallback"
    assert raw.headers["x-chatroute-provider"] == "local"
    assert raw.headers["x-chatroute-attempts"] == "2"
    # The silent upstream's connection was closed, not left hanging.
    stack.upstreams["strong"].wait_for_disconnect(0)
    (trace,) = stack.wait_traces(1)
    first = trace.attempts[0]
    assert (first.provider, first.outcome) == ("strong", "failed")
    assert first.failure_kind == "first_token_timeout"


def test_the_silent_upstream_is_not_tried_again_in_the_same_request(
    example_stack: ServiceStack,
) -> None:
    stack = example_stack
    stack.reset()
    stack.upstreams["strong"].default = Hang()
    stack.upstreams["local"].default = Hang()
    from openai import APIStatusError

    with pytest.raises(APIStatusError) as caught:
        stack.client.chat.completions.create(
            model="code",
            messages=[{"role": "user", "content": "fix this bug in my python code"}],
            stream=True,
        )
    assert caught.value.status_code == 504
    assert stack.attempts() == {"local": 1, "strong": 1}


def test_a_silent_upstream_is_failed_over_on_a_non_streamed_request_too(
    example_stack: ServiceStack,
) -> None:
    # No stream, so no first token: the first-token limit bounds the wait for the answer
    # to begin (its response head), not only the 300 s read timeout.
    stack = example_stack
    stack.reset()
    stack.upstreams["strong"].default = Hang()
    stack.upstreams["local"].default = Ok("answered by the fallback")
    raw = stack.client.chat.completions.with_raw_response.create(
        model="code",
        messages=[{"role": "user", "content": "fix this bug in my python code"}],
    )
    assert raw.parse().choices[0].message.content == "answered by the fallback"
    assert raw.headers["x-chatroute-provider"] == "local"
    assert raw.headers["x-chatroute-attempts"] == "2"
    stack.upstreams["strong"].wait_for_disconnect(0)
    (trace,) = stack.wait_traces(1)
    first = trace.attempts[0]
    assert (first.provider, first.outcome) == ("strong", "failed")
    assert first.failure_kind == "first_token_timeout"
