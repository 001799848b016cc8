"""`POST /v1/embeddings` and `GET /v1/models/{id}` over real sockets with the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from chatroute.chat import EmbeddingGenerator
from chatroute.config import parse_config
from chatroute.embedder import SentenceTransformerEmbedder
from chatroute.server import create_app
from tests.embedder_helpers import ForwardGate
from tests.fakes import FakeUpstream

KEY = "embed-key-0123456789"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
ATOL = 1e-5
MAX_INPUTS = 8
MAX_CHARS = 4000
TEXTS = [
    "how do I reset my password",
    "",
    "Ünïcödé & symbols: €100 #tag @user :)",
    "what's the weather going to be like in Lusaka tomorrow afternoon?",
    " ".join(["a long text that the model cuts at its maximum sequence length"] * 40),
]


def _config(url: str) -> dict[str, Any]:
    return {
        "server": {"max_classify_inputs": MAX_INPUTS, "max_message_chars": MAX_CHARS},
        "routing": {"default_route": "general"},
        "providers": {"up": {"base_url": url, "model": "up-model"}},
        "routes": {
            "billing": {"utterances": ["refund my order"], "targets": ["up"]},
            "general": {"targets": ["up"]},
        },
    }


@contextlib.contextmanager
def _service(
    embedder: EmbeddingGenerator, serve_app: Callable[..., Any]
) -> Iterator[tuple[str, Any]]:
    with FakeUpstream() as up:
        config = parse_config(_config(up.base_url), environ={})
        app = create_app(config, api_keys=[KEY], environ={}, embedder=embedder)
        with serve_app(app) as url:
            yield url, app


@pytest.fixture(scope="module")
def inner(default_embedder: Callable[[], EmbeddingGenerator]) -> SentenceTransformerEmbedder:
    shared: Any = default_embedder()
    emb = shared.inner
    assert isinstance(emb, SentenceTransformerEmbedder)
    return emb


@pytest.fixture(scope="module")
def service(
    default_embedder: Callable[[], EmbeddingGenerator], serve_app: Callable[..., Any]
) -> Iterator[str]:
    with _service(default_embedder(), serve_app) as (url, _):
        yield url


@pytest.fixture
def client(service: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{service}/v1", api_key=KEY, max_retries=0) as made:
        yield made


def _library(emb: SentenceTransformerEmbedder, texts: list[str]) -> np.ndarray:
    """What the library's own `generate()` gives for the texts."""
    return asyncio.run(emb.generate(texts))


def _token_count(emb: SentenceTransformerEmbedder, texts: list[str]) -> int:
    """Tokens per text by the model's own (Hugging Face) tokeniser, cut as the model cuts."""
    runner = emb._runner
    ids = runner._st.tokenizer(texts, truncation=True, max_length=runner.max_seq_length)
    return sum(len(row) for row in ids["input_ids"])


def test_float_embeddings_equal_generate(
    client: openai.OpenAI, inner: SentenceTransformerEmbedder
) -> None:
    answer = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    got = np.array([item.embedding for item in answer.data], dtype=np.float32)
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))
    assert got.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(got, _library(inner, TEXTS), atol=ATOL)
    assert answer.model == MODEL and answer.object == "list"
    tokens = _token_count(inner, TEXTS)
    assert answer.usage.prompt_tokens == tokens == answer.usage.total_tokens
    assert tokens > 256  # the long text counted as the model read it: cut at 256


def test_base64_embeddings_equal_generate(
    client: openai.OpenAI, inner: SentenceTransformerEmbedder, service: str
) -> None:
    # The SDK asks for base64 when no format is given, and decodes it itself.
    answer = client.embeddings.create(model=MODEL, input=TEXTS)
    got = np.array([item.embedding for item in answer.data], dtype=np.float32)
    want = _library(inner, TEXTS)
    np.testing.assert_allclose(got, want, atol=ATOL)
    # On the wire: little-endian float32, what OpenAI sends.
    raw = httpx.post(
        f"{service}/v1/embeddings",
        json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert raw.status_code == 200, raw.text
    body = raw.json()
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, want[0], atol=ATOL)
    assert body["usage"] == {"prompt_tokens": _token_count(inner, TEXTS[:1])} | {
        "total_tokens": _token_count(inner, TEXTS[:1])
    }


def test_string_input_and_the_model_own_dimension(
    client: openai.OpenAI, inner: SentenceTransformerEmbedder
) -> None:
    answer = client.embeddings.create(
        model=MODEL, input="refund my order", dimensions=384, encoding_format="float"
    )
    assert len(answer.data) == 1
    np.testing.assert_allclose(
        answer.data[0].embedding, _library(inner, ["refund my order"])[0], atol=ATOL
    )
    # The configured name of the model is accepted as well, and answered with the real one.
    answer = client.embeddings.create(model="default", input="x")
    assert answer.model == MODEL


def _bad_request(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict)
    return body


def test_other_dimensions_are_refused_naming_the_param(client: openai.OpenAI) -> None:
    error = _bad_request(lambda: client.embeddings.create(model=MODEL, input="x", dimensions=256))
    assert error["param"] == "dimensions"
    assert "384" in error["message"] and "dimensions" in error["message"]


@pytest.mark.parametrize("tokens", [[1, 2, 3], [[1, 2], [3]]])
def test_token_arrays_are_a_400(client: openai.OpenAI, tokens: Any) -> None:
    error = _bad_request(lambda: client.embeddings.create(model=MODEL, input=tokens))
    assert error["param"] == "input" and error["code"] == "unsupported_input"
    assert "token arrays are not supported" in error["message"]


@pytest.mark.parametrize(
    ("value", "param", "fragment"),
    [
        ([], "input", "empty"),
        (["ok", 3], "input[1]", "must be a string"),
        ({"text": "x"}, "input", "a string or a list of strings"),
        ([["not", "tokens"]], "input[0]", "must be a string"),
        ([f"t{i}" for i in range(MAX_INPUTS + 1)], "input", f"at most {MAX_INPUTS} inputs"),
        (["ok", "x" * (MAX_CHARS + 1)], "input[1]", f"at most {MAX_CHARS} characters"),
    ],
)
def test_bad_input_gets_a_400_naming_it(
    client: openai.OpenAI, value: Any, param: str, fragment: str
) -> None:
    error = _bad_request(lambda: client.embeddings.create(model=MODEL, input=value))
    assert error["param"] == param
    assert fragment in error["message"]


def test_bad_format_unknown_model_and_auth(client: openai.OpenAI, service: str) -> None:
    error = _bad_request(
        lambda: client.embeddings.create(
            model=MODEL,
            input="x",
            encoding_format="int8",  # type: ignore[arg-type]
        )
    )
    assert error["param"] == "encoding_format"
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert MODEL in str(missing.value)
    with (
        openai.OpenAI(base_url=f"{service}/v1", api_key="wrong", max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.embeddings.create(model=MODEL, input="x")


def test_unknown_fields_are_ignored_and_named(service: str) -> None:
    answer = httpx.post(
        f"{service}/v1/embeddings",
        json={"model": MODEL, "input": "x", "input_type": "query", "user": "u1"},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert answer.status_code == 200
    assert answer.headers["x-chatroute-ignored-params"] == "input_type"


def test_bodies_that_are_not_a_request_object_are_400s_and_the_schema_is_published(
    service: str,
) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    for content, kind in (
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"input=x", "application/x-www-form-urlencoded"),
        (b'{"input": "x"', "application/json"),
    ):
        answer = httpx.post(
            f"{service}/v1/embeddings", content=content, headers={**auth, "content-type": kind}
        )
        assert answer.status_code == 400, (content, answer.text)
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    document = httpx.get(f"{service}/openapi.json").json()
    body = document["paths"]["/v1/embeddings"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"input", "model", "encoding_format", "dimensions"} <= set(schema["properties"])


def test_the_embedder_is_listed_and_retrievable(client: openai.OpenAI) -> None:
    listed = {model.id: model for model in client.models.list()}
    assert {"auto", "billing", "general", MODEL} <= set(listed)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert (card.model_extra or {}).get("dimensions") == 384
    assert client.models.retrieve("billing").id == "billing"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    body = missing.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and "no-such-model" in body["message"]


def test_a_full_embedder_queue_is_a_503_with_retry_after(
    inner: SentenceTransformerEmbedder,
    serve_app: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emb = SentenceTransformerEmbedder(
        _runner=inner._runner, warmup=False, max_queue=4, workers=1
    )  # one model thread: the held pass holds the queue
    try:
        with _service(emb, serve_app) as (url, _):
            gate = ForwardGate(emb, monkeypatch)  # after start-up: holds the next pass
            http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"})
            answers: list[httpx.Response] = []

            def post(texts: list[str]) -> None:
                answers.append(http.post("/v1/embeddings", json={"model": MODEL, "input": texts}))

            first = threading.Thread(target=post, args=(["in flight"],))
            first.start()
            assert gate.started.wait(60)
            queued = threading.Thread(target=post, args=(["a", "b", "c"],))
            queued.start()
            for _ in range(6000):
                if emb.queue_depth == 3:
                    break
                threading.Event().wait(0.005)
            assert emb.queue_depth == 3
            refused = http.post("/v1/embeddings", json={"model": MODEL, "input": ["d", "e"]})
            gate.open()
            first.join(60)
            queued.join(60)
            http.close()
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert sorted(a.status_code for a in answers) == [200, 200]
    finally:
        emb.close()
