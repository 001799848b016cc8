"""The OpenAI surface through the real service: option precedence and `override`, pass-through
of fields chatroute does not know, `n` > 1, `max_completion_tokens`, CORS; the openai SDK as
the client, scripted fake upstreams recording what they received."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from chatroute.server.handlers import DirectRoute
from tests.conftest import ServiceStack
from tests.fakes import Events, Status

ORIGIN = "https://app.example"
VLLM_PARAMS: dict[str, Any] = {
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "chat_template_kwargs": {"enable_thinking": False},
    "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}},
}
USER = [{"role": "user", "content": "hello there"}]


def _config(urls: dict[str, str]) -> dict[str, Any]:
    def provider(name: str, **extra: Any) -> dict[str, Any]:
        return {"base_url": urls[name], "model": f"model-{name}", **extra}

    return {
        "server": {"cors": {"allow_origins": [ORIGIN]}},
        "routing": {"default_route": "general"},
        "providers": {
            "vllm": provider("vllm"),
            "strict": provider("strict", pass_through="none"),
            "picky": provider("picky", pass_through=["top_k", "min_p"]),
            "tuned": provider("tuned", extra_body={"top_k": 5}),
        },
        "routes": {
            "general": {
                "utterances": ["hello there", "tell me something"],
                "targets": ["vllm"],
                "options": {"temperature": 0.8, "max_tokens": 300},
            },
            "forced": {
                "targets": ["vllm"],
                "options": {"temperature": 0.8},
                "override": {"temperature": 0.3, "seed": 11, "extra_body": {"min_p": 0.2}},
            },
            "strict": {"targets": ["strict"]},
            "picky": {"targets": ["picky"]},
            "tuned": {"targets": ["tuned"]},
        },
    }


@pytest.fixture(scope="module")
def stack(
    service_stack: Callable[..., contextlib.AbstractContextManager[ServiceStack]],
) -> Iterator[ServiceStack]:
    with service_stack(_config, ["vllm", "strict", "picky", "tuned"]) as made:
        yield made


@pytest.fixture(autouse=True)
def fresh(stack: ServiceStack) -> None:
    stack.reset()


def _chat(stack: ServiceStack, route: str, **kwargs: Any) -> Any:
    return stack.client.chat.completions.with_raw_response.create(
        model=route, messages=USER, **kwargs
    )


def _sent(stack: ServiceStack, name: str) -> dict[str, Any]:
    (request,) = stack.upstreams[name].requests
    body: dict[str, Any] = request.json
    return body


# ----------------------------------------------------------------------------- precedence


def test_the_callers_temperature_wins_over_the_routes_option(stack: ServiceStack) -> None:
    raw = _chat(stack, "general", temperature=0)
    assert "x-chatroute-overridden" not in raw.headers
    sent = _sent(stack, "vllm")
    assert sent["temperature"] == 0  # not the route's 0.8
    assert sent["max_tokens"] == 300  # the route's default, the caller sent none


def test_the_routes_options_fill_in_what_the_caller_left_unset(stack: ServiceStack) -> None:
    _chat(stack, "general")
    sent = _sent(stack, "vllm")
    assert (sent["temperature"], sent["max_tokens"]) == (0.8, 300)


def test_an_override_forces_its_values_and_the_answer_names_them(stack: ServiceStack) -> None:
    raw = _chat(stack, "forced", temperature=0, seed=11, extra_body={"min_p": 0.5})
    sent = _sent(stack, "vllm")
    assert (sent["temperature"], sent["seed"], sent["min_p"]) == (0.3, 11, 0.2)
    # The seed the caller sent was the forced one: not named.
    assert raw.headers["x-chatroute-overridden"] == "min_p,temperature"


def test_an_override_of_what_the_caller_left_unset_names_nothing(stack: ServiceStack) -> None:
    raw = _chat(stack, "forced")
    sent = _sent(stack, "vllm")
    assert (sent["temperature"], sent["seed"], sent["min_p"]) == (0.3, 11, 0.2)
    assert "x-chatroute-overridden" not in raw.headers


def test_a_streamed_answer_names_the_overridden_fields_too(stack: ServiceStack) -> None:
    raw = _chat(stack, "forced", temperature=1.5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert raw.headers["x-chatroute-overridden"] == "temperature"
    assert _sent(stack, "vllm")["temperature"] == 0.3


# ---------------------------------------------------------------------------- pass-through


def test_vllm_parameters_reach_an_openai_compatible_upstream(stack: ServiceStack) -> None:
    raw = _chat(stack, "general", extra_body=VLLM_PARAMS)
    assert "x-chatroute-ignored-params" not in raw.headers
    sent = _sent(stack, "vllm")
    for name, value in VLLM_PARAMS.items():
        assert sent[name] == value, name


def test_pass_through_none_drops_unknown_fields_and_names_them(stack: ServiceStack) -> None:
    raw = _chat(stack, "strict", extra_body=VLLM_PARAMS, logprobs=True)
    sent = _sent(stack, "strict")
    assert not set(VLLM_PARAMS) & set(sent)
    assert sent["logprobs"] is True  # an OpenAI field, not an unknown one
    assert raw.headers["x-chatroute-ignored-params"] == ",".join(sorted(VLLM_PARAMS))


def test_pass_through_a_list_forwards_only_the_fields_named(stack: ServiceStack) -> None:
    raw = _chat(stack, "picky", extra_body=VLLM_PARAMS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    sent = _sent(stack, "picky")
    assert (sent["top_k"], sent["min_p"]) == (20, 0.05)
    assert not {"repetition_penalty", "chat_template_kwargs", "guided_json"} & set(sent)
    assert raw.headers["x-chatroute-ignored-params"] == (
        "chat_template_kwargs,guided_json,repetition_penalty"
    )


def test_the_operators_extra_body_wins_over_the_callers_field(stack: ServiceStack) -> None:
    _chat(stack, "tuned", extra_body={"top_k": 40, "min_p": 0.1})
    sent = _sent(stack, "tuned")
    assert (sent["top_k"], sent["min_p"]) == (5, 0.1)


def test_max_completion_tokens_reaches_the_upstream_as_sent(stack: ServiceStack) -> None:
    _chat(stack, "general", max_completion_tokens=77)
    sent = _sent(stack, "vllm")
    assert sent["max_completion_tokens"] == 77 and "max_tokens" not in sent
    stack.reset()
    _chat(stack, "general", max_tokens=66)
    sent = _sent(stack, "vllm")
    assert sent["max_tokens"] == 66 and "max_completion_tokens" not in sent


# ---------------------------------------------------------------------------------- n > 1


def _two_choices(model: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-n2",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            for i, text in enumerate(["first answer", "second answer"])
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def test_n_2_returns_every_choice(stack: ServiceStack) -> None:
    stack.upstreams["vllm"].script(Status(200, body=_two_choices("model-vllm")))
    completion = _chat(stack, "general", n=2).parse()
    assert [(c.index, c.message.content) for c in completion.choices] == [
        (0, "first answer"),
        (1, "second answer"),
    ]
    assert _sent(stack, "vllm")["n"] == 2


def _chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n"


def test_n_2_streams_every_choice(stack: ServiceStack) -> None:
    events = [
        _chunk(0, {"role": "assistant", "content": ""}),
        _chunk(1, {"role": "assistant", "content": ""}),
        _chunk(0, {"content": "first "}),
        _chunk(1, {"content": "second "}),
        _chunk(0, {"content": "answer"}, "stop"),
        _chunk(1, {"content": "answer"}),
        _chunk(1, {}, "length"),
        "data: [DONE]\n\n",
    ]
    stack.upstreams["vllm"].script(Events(events))
    chunks = list(_chat(stack, "general", n=2, stream=True).parse())
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {0: "first answer", 1: "second answer"}
    assert finishes == {0: "stop", 1: "length"}


# ------------------------------------------------------------------------------------ CORS


def test_a_cors_preflight_is_answered_without_a_key(stack: ServiceStack) -> None:
    import httpx

    preflight = httpx.options(
        f"{stack.url}/v1/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = httpx.options(
        f"{stack.url}/v1/chat/completions",
        headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
    )
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_a_cross_origin_answer_exposes_the_chatroute_headers(stack: ServiceStack) -> None:
    answer = stack.http.post(
        "/v1/chat/completions",
        json={"model": "general", "messages": USER},
        headers={"origin": ORIGIN},
    )
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    exposed = answer.headers["access-control-expose-headers"].lower()
    assert "x-chatroute-provider" in exposed and "x-chatroute-overridden" in exposed


def test_the_chat_routing_and_embeddings_paths_are_matched_first_and_the_rest_still_answer(
    stack: ServiceStack,
) -> None:
    paths = [getattr(route, "path", None) for route in stack.app.router.routes]
    assert paths[:4] == ["/v1/chat/completions", "/v1/route", "/v1/classify", "/v1/embeddings"]
    # The routes behind them still answer, the docs and the nested models router included.
    assert stack.http.get("/healthz").json() == {"status": "ok"}
    assert stack.http.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]
    assert stack.http.get("/v1/models/general").json()["id"] == "general"
    assert stack.http.get("/v1/models/nothing-here").status_code == 404


def test_a_direct_route_refuses_an_endpoint_it_could_not_call_with_the_request_alone() -> None:
    async def takes_more(request: Request, limit: int = 3) -> Response:
        return Response()

    def not_async(request: Request) -> Response:
        return Response()

    async def fine(request: Request) -> Response:
        return Response(b"ok")

    app = FastAPI()
    for endpoint in (takes_more, not_async):
        with pytest.raises(TypeError, match="only the request"):
            app.router.add_api_route("/x", endpoint, route_class_override=DirectRoute)
    with pytest.raises(TypeError, match="dependencies"):
        app.router.add_api_route(
            "/y", fine, route_class_override=DirectRoute, dependencies=[Depends(lambda: None)]
        )
    app.router.add_api_route("/z", fine, methods=["POST"], route_class_override=DirectRoute)
    assert "/z" in app.openapi()["paths"]
