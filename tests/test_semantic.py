"""SemanticRoutingChatClient: the ported upstream tests and the SR rules of the contract."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
from semantic_doubles import FINGERPRINT, FakeEmbeddingGenerator, NamedClient, user

from chatroute.chat import ChatMessage, ChatRole, EmbeddingFingerprint, TextContent
from chatroute.index import FingerprintMismatchError, InvalidEmbeddingError, ProfileIndex
from chatroute.router import (
    RouteDecision,
    RouteMatch,
    RoutingChatClient,
    ScoreAggregation,
    SemanticRoutingChatClient,
)

CODE = "write a python function"
WRITING = "write a poem"


def make_router(
    table: dict[str, list[float]],
    profiles: dict[NamedClient, list[str]],
    default: NamedClient,
    **kwargs: Any,
) -> tuple[SemanticRoutingChatClient, FakeEmbeddingGenerator]:
    generator = FakeEmbeddingGenerator(table)
    return SemanticRoutingChatClient(generator, profiles, default, **kwargs), generator


def count_searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch ProfileIndex.search to record the number of query rows of each call."""
    calls: list[int] = []
    original = ProfileIndex.search

    def spy(self: ProfileIndex, queries: Any, k: int, **kwargs: Any) -> Any:
        calls.append(len(queries))
        return original(self, queries, k, **kwargs)

    monkeypatch.setattr(ProfileIndex, "search", spy)
    return calls


# -- ported upstream tests (checklist rows 61-65) ---------------------------------------------


async def test_semantic_rejects_invalid_configuration() -> None:
    gen = FakeEmbeddingGenerator({"a": [1.0, 0.0]})
    code, default = NamedClient("code"), NamedClient("default")
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(None, {code: ["a"]}, default)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, None, default)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, {code: ["a"]}, None)  # type: ignore[arg-type]
    for profiles in ({}, {code: []}, {code: [" "]}):
        with pytest.raises(ValueError):
            SemanticRoutingChatClient(gen, profiles, default)
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(
            gen,
            {code: ["a"]},
            default,
            score_threshold=1.1,
            score_aggregation=ScoreAggregation.MEAN,
        )
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {code: ["a"]}, default, top_k=0)
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {code: ["a"]}, default, score_aggregation=99)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(
            gen,
            {code: ["a"]},
            default,
            score_threshold=2.1,
            top_k=2,
            score_aggregation=ScoreAggregation.SUM,
        )


async def test_semantic_selects_best_profile_and_caches_index() -> None:
    code, writing = NamedClient("code"), NamedClient("writing")
    router, gen = make_router(
        {CODE: [1, 0], WRITING: [0, 1], "q": [1, 0]}, {code: [CODE], writing: [WRITING]}, writing
    )
    first = await router.get_response(user("q"))
    second = await router.get_response(user("q"))
    assert first.text == "code" and second.text == "code"
    assert len(code.requests) == 2 and writing.requests == []
    assert [call for call in gen.calls if len(call) > 1] == [[CODE, WRITING]]
    assert gen.calls == [[CODE, WRITING], ["q"], ["q"]]


@pytest.mark.parametrize(
    ("aggregation", "threshold", "expected"),
    [(ScoreAggregation.MEAN, 0.3, "code"), (ScoreAggregation.SUM, 1.5, "writing")],
)
async def test_semantic_aggregates_global_top_k_by_client(
    aggregation: ScoreAggregation, threshold: float, expected: str
) -> None:
    code, writing = NamedClient("code"), NamedClient("writing")
    table = {"c": [1, 0], "w1": [0.8, 0.6], "w2": [0.8, -0.6], "q": [1, 0]}
    router, _ = make_router(
        table,
        {code: ["c"], writing: ["w1", "w2"]},
        NamedClient("default"),
        top_k=3,
        score_aggregation=aggregation,
        score_threshold=threshold,
    )
    response = await router.get_response(user("q"))
    assert response.text == expected
    decision = await router.route(user("q"))
    assert decision.scores[code] == pytest.approx(1.0)
    if aggregation is ScoreAggregation.SUM:
        assert decision.scores[writing] == pytest.approx(1.6)
    else:
        assert decision.scores[writing] == pytest.approx(0.8)


async def test_semantic_uses_default_below_threshold() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, _ = make_router({"c": [1, 0], "q": [0, 1]}, {code: ["c"]}, default, score_threshold=0.5)
    response = await router.get_response(user("q"))
    assert response.text == "default"
    assert code.requests == [] and len(default.requests) == 1


async def test_semantic_closes_owned_resources_once() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0]}, {code: ["c"]}, default)
    await router.aclose()
    await router.aclose()
    assert (gen.close_count, code.close_count, default.close_count) == (1, 1, 1)


# -- SR1: construction -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "top_k", "limit"),
    [
        (ScoreAggregation.MEAN, 3, 1.0),
        (ScoreAggregation.MAX, 3, 1.0),
        (ScoreAggregation.SUM, 3, 3.0),
        (ScoreAggregation.SUM, 1, 1.0),
    ],
)
async def test_semantic_threshold_bounds_per_aggregation(
    aggregation: ScoreAggregation, top_k: int, limit: float
) -> None:
    gen = FakeEmbeddingGenerator({"a": [1.0, 0.0]})
    code, default = NamedClient("code"), NamedClient("default")

    def build(threshold: Any) -> SemanticRoutingChatClient:
        return SemanticRoutingChatClient(
            gen,
            {code: ["a"]},
            default,
            score_threshold=threshold,
            top_k=top_k,
            score_aggregation=aggregation,
        )

    assert build(limit).score_threshold == limit
    assert build(-limit).score_threshold == -limit
    assert build(np.float32(0.25)).score_threshold == 0.25
    for bad in (math.nextafter(limit, math.inf), -math.nextafter(limit, math.inf)):
        with pytest.raises(ValueError):
            build(bad)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError):
            build(bad)
    for wrong_type in (True, "0.3", None):
        with pytest.raises(TypeError):
            build(wrong_type)


async def test_semantic_construction_type_checks_and_order() -> None:
    gen = FakeEmbeddingGenerator({"a": [1.0, 0.0]})
    code, default = NamedClient("code"), NamedClient("default")
    for top_k in (True, 1.0, "1"):
        with pytest.raises(TypeError):
            SemanticRoutingChatClient(gen, {code: ["a"]}, default, top_k=top_k)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {code: ["a"]}, default, score_aggregation="mean")  # type: ignore[arg-type]
    # Check order: empty profiles (2) before top_k (3); top_k before aggregation (4);
    # aggregation before threshold (5); threshold before utterances (6).
    with pytest.raises(ValueError, match="at least one"):
        SemanticRoutingChatClient(gen, {}, default, top_k="x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="top_k"):
        SemanticRoutingChatClient(
            gen,
            {code: ["a"]},
            default,
            top_k="x",
            score_aggregation="bad",  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="score_aggregation"):
        SemanticRoutingChatClient(
            gen,
            {code: ["a"]},
            default,
            score_aggregation="bad",
            score_threshold="x",  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match="score_threshold"):
        SemanticRoutingChatClient(gen, {code: [""]}, default, score_threshold="x")  # type: ignore[arg-type]


async def test_semantic_profile_entry_checks() -> None:
    gen = FakeEmbeddingGenerator({"a": [1.0, 0.0]})
    code, other, default = NamedClient("code"), NamedClient("other"), NamedClient("default")
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {None: ["a"]}, default)  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {code: None}, default)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, {code: "a"}, default)
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, {code: ["a", 3]}, default)  # type: ignore[list-item]
    for blank in (None, "", "\t\n "):
        with pytest.raises(ValueError):
            SemanticRoutingChatClient(gen, {code: ["a", blank]}, default)  # type: ignore[list-item]
    # Within an entry, a non-str utterance (TypeError) is reported before a blank one.
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, {code: ["", 3]}, default)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {code: ""}, default)
    # Entries are checked in mapping order: the first bad entry decides the error.
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, {code: "a", other: [""]}, default)
    with pytest.raises(ValueError):
        SemanticRoutingChatClient(gen, {code: [""], other: "a"}, default)


async def test_semantic_copies_profiles_at_construction() -> None:
    code, other, default = NamedClient("code"), NamedClient("other"), NamedClient("default")
    utterances = ["c"]
    profiles = {code: utterances}
    router, gen = make_router({"c": [1, 0], "o": [0, 1], "q": [0, 1]}, profiles, default)
    utterances.append("o")
    profiles[other] = ["o"]
    decision = await router.route(user("q"))
    assert gen.calls[0] == ["c"]
    assert decision.winner is code and decision.is_default
    assert router.profiles == ((code, "c"),)


# -- SR2, SR3: routes and the query ------------------------------------------------------------


async def test_semantic_default_client_that_is_also_a_profile_key() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    table = {"c": [1, 0], "d": [0, 1], "q": [0, 1]}
    router, _ = make_router(table, {code: ["c"], default: ["d"]}, default)
    decision = await router.route(user("q"))
    assert decision.client is default and not decision.is_default
    assert decision.score == pytest.approx(1.0)
    assert router.clients == (default, code)
    await router.aclose()
    assert default.close_count == 1 and code.close_count == 1


async def test_semantic_no_user_message_or_blank_query_uses_default_without_embedding() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0]}, {code: ["c"]}, default)
    conversations = [
        [],
        [ChatMessage(ChatRole.SYSTEM, "c"), ChatMessage(ChatRole.ASSISTANT, "c")],
        [ChatMessage(ChatRole.USER, "c"), ChatMessage(ChatRole.USER, "")],
        [ChatMessage(ChatRole.USER, "c"), ChatMessage(ChatRole.USER, " \t\n")],
        [ChatMessage(ChatRole.USER, contents=[])],
    ]
    for messages in conversations:
        decision = await router.route(messages)
        assert decision == RouteDecision(client=default)
        assert decision.is_default and decision.score is None
        assert decision.scores == {} and decision.matches == ()
        assert (await router.get_response(messages)).text == "default"
    assert gen.calls == []
    assert code.requests == []


async def test_semantic_query_is_last_user_text_verbatim() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    table = {"c": [1, 0], " q ": [1, 0], "ab": [1, 0]}
    router, gen = make_router(table, {code: ["c"]}, default, score_threshold=0.5)
    messages = [
        ChatMessage(ChatRole.USER, "earlier"),
        ChatMessage(ChatRole.ASSISTANT, "reply"),
        ChatMessage(ChatRole.USER, " q "),
        ChatMessage(ChatRole.ASSISTANT, "after"),
    ]
    assert (await router.route(messages)).client is code
    multi = [ChatMessage(ChatRole.USER, contents=[TextContent("a"), TextContent("b")])]
    assert (await router.route(multi)).client is code
    assert gen.calls[1:] == [[" q "], ["ab"]]


# -- SR4: the profile index -------------------------------------------------------------------


async def test_semantic_concurrent_first_requests_build_index_once() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "d": [0, 1], "q": [1, 0]}, {code: ["c", "d"]}, default)
    gen.gate = asyncio.Event()
    tasks = [asyncio.create_task(router.get_response(user("q"))) for _ in range(5)]
    await asyncio.sleep(0.01)
    assert gen.calls == [["c", "d"]]
    gen.gate.set()
    responses = await asyncio.gather(*tasks)
    assert [r.text for r in responses] == ["code"] * 5
    assert [call for call in gen.calls if len(call) > 1] == [["c", "d"]]
    assert gen.calls.count(["q"]) == 5


async def test_semantic_generator_failure_is_not_cached() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    boom = RuntimeError("embedding service down")
    gen.fail_next = [boom]
    with pytest.raises(RuntimeError) as caught:
        await router.get_response(user("q"))
    assert caught.value is boom
    assert router.profile_index is None
    assert code.requests == [] and default.requests == []
    assert (await router.get_response(user("q"))).text == "code"
    assert gen.calls == [["c"], ["c"], ["q"]]


async def test_semantic_query_failure_propagates_through_all_paths() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    await router.route(user("q"))
    errors = [ValueError("a"), asyncio.CancelledError(), KeyError("b")]
    gen.fail_next = list(errors)
    with pytest.raises(ValueError):
        await router.route(user("q"))
    with pytest.raises(asyncio.CancelledError):
        await router.get_response(user("q"))
    stream = router.get_streaming_response(user("q"))
    with pytest.raises(KeyError):
        await anext(stream)
    assert code.requests == [] and default.requests == [] and default.stream_requests == []


async def test_semantic_cancelled_build_is_not_cached_and_waiter_retries() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    gen.gate = asyncio.Event()
    first = asyncio.create_task(router.route(user("q")))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(router.route(user("q")))
    await asyncio.sleep(0.01)
    assert gen.calls == [["c"]]
    first.cancel()
    await asyncio.wait([first])
    assert first.cancelled()
    assert router.profile_index is None
    await asyncio.sleep(0.01)
    gen.gate.set()
    decision = await second
    assert decision.client is code
    assert gen.calls == [["c"], ["c"], ["q"]]


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda m: m[:1], id="too-few-rows"),
        pytest.param(lambda m: np.concatenate([m, m]), id="too-many-rows"),
        pytest.param(lambda m: m[:, 0], id="one-dimensional"),
        pytest.param(lambda m: m[:, :0], id="zero-dimension"),
        pytest.param(lambda m: np.where(m == 1, np.nan, m), id="nan"),
        pytest.param(lambda m: np.where(m == 1, np.inf, m), id="inf"),
        pytest.param(lambda m: m * np.array([[1.0], [0.0]], dtype=np.float32), id="zero-row"),
        pytest.param(lambda m: None, id="none"),
        pytest.param(lambda m: [["x", "y"], ["z", "w"]], id="not-numeric"),
    ],
)
async def test_semantic_rejects_malformed_profile_embeddings(transform: Any) -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "d": [0, 1], "q": [1, 0]}, {code: ["c", "d"]}, default)
    gen.transform = transform
    with pytest.raises(RuntimeError):
        await router.get_response(user("q"))
    assert router.profile_index is None
    assert code.requests == [] and default.requests == []


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda m: np.concatenate([m, m]), id="two-rows"),
        pytest.param(lambda m: np.zeros((1, 3), dtype=np.float32) + 1, id="wrong-dimension"),
        pytest.param(lambda m: m[0], id="one-dimensional"),
        pytest.param(lambda m: m * np.nan, id="nan"),
    ],
)
async def test_semantic_rejects_malformed_query_embeddings(transform: Any) -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    await router.route(user("q"))
    gen.transform = transform
    with pytest.raises(InvalidEmbeddingError):
        await router.route(user("q"))
    with pytest.raises(RuntimeError):
        await router.get_response(user("q"))
    assert code.requests == [] and default.requests == []


async def test_semantic_does_not_modify_generator_output() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [3, 4], "q": [0, 2]}, {code: ["c"]}, default)
    await router.route(user("q"))
    assert gen.returned[0].tolist() == [[3.0, 4.0]]
    assert gen.returned[1].tolist() == [[0.0, 2.0]]
    assert router.profile_index is not None
    assert router.profile_index.vectors[0].tolist() == pytest.approx([0.6, 0.8])


# -- SR5 - SR10: scoring ------------------------------------------------------------------------


async def test_semantic_zero_query_vector_uses_default_without_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    searches = count_searches(monkeypatch)
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router(
        {"c": [1, 0], "zero": [0, 0]}, {code: ["c"]}, default, score_threshold=-1.0
    )
    decision = await router.route(user("zero"))
    assert decision == RouteDecision(client=default)
    assert gen.calls == [["c"], ["zero"]]
    assert searches == []


async def test_semantic_score_equal_to_threshold_is_selected() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    exact = float(np.float32(0.6))  # the float32 cosine of [3, 4] and [1, 0]
    table = {"c": [3, 4], "q": [1, 0]}
    at, _ = make_router(table, {code: ["c"]}, default, score_threshold=exact)
    above, _ = make_router(
        table, {code: ["c"]}, default, score_threshold=math.nextafter(exact, 1.0)
    )
    hit = await at.route(user("q"))
    assert hit.client is code and not hit.is_default and hit.score == exact
    miss = await above.route(user("q"))
    assert miss.client is default and miss.is_default and miss.score == exact
    assert miss.winner is code


async def test_semantic_ties_at_top_k_one_go_to_lower_profile_index() -> None:
    first, second, default = NamedClient("first"), NamedClient("second"), NamedClient("default")
    table = {"a": [1, 0], "b": [1, 0], "q": [1, 0]}
    router, _ = make_router(table, {first: ["a"], second: ["b"]}, default)
    assert (await router.route(user("q"))).client is first
    swapped, _ = make_router(table, {second: ["b"], first: ["a"]}, default)
    assert (await swapped.route(user("q"))).client is second


async def test_semantic_ties_at_top_k_cut_off_keep_lower_profile_indexes() -> None:
    a, b, c, default = NamedClient("a"), NamedClient("b"), NamedClient("c"), NamedClient("d")
    # Profile indexes 0..3: a:"x0", b:"x1", c:"x2", c:"x3"; x1..x3 tie just below x0.
    table = {"x0": [1, 0], "x1": [0.8, 0.6], "x2": [0.8, 0.6], "x3": [0.8, -0.6], "q": [1, 0]}
    router, _ = make_router(
        table,
        {a: ["x0"], b: ["x1"], c: ["x2", "x3"]},
        default,
        top_k=3,
        score_aggregation=ScoreAggregation.SUM,
        score_threshold=0.0,
    )
    decision = await router.route(user("q"))
    assert [m.utterance for m in decision.matches] == ["x0", "x1", "x2"]
    assert [m.profile_index for m in decision.matches] == [0, 1, 2]
    assert list(decision.scores) == [a, b, c]
    assert decision.scores[c] == pytest.approx(0.8)


async def test_semantic_equal_aggregates_go_to_first_appearing_client() -> None:
    a, b, default = NamedClient("a"), NamedClient("b"), NamedClient("default")
    # Ranking: b1 (1.0), a1 (0.8), b2 (0.6). MEAN: b = (1.0 + 0.6) / 2 = 0.8 = a, exactly in
    # float32 terms. b appears first in the ranking, so b wins although a is listed first.
    table = {"a1": [4, 3], "b1": [1, 0], "b2": [3, 4], "q": [1, 0]}
    router, _ = make_router(
        table, {a: ["a1"], b: ["b1", "b2"]}, default, top_k=3, score_threshold=0.0
    )
    decision = await router.route(user("q"))
    assert decision.scores[a] == decision.scores[b]
    assert list(decision.scores) == [b, a]
    assert decision.client is b


async def test_semantic_top_k_above_profile_count_and_max_aggregation() -> None:
    code, writing, default = NamedClient("code"), NamedClient("writing"), NamedClient("default")
    table = {"c": [0.9, 0.43588989], "w1": [0.8, 0.6], "w2": [0.8, -0.6], "q": [1, 0]}
    profiles = {code: ["c"], writing: ["w1", "w2"]}
    router, _ = make_router(
        table, profiles, default, top_k=10, score_aggregation=ScoreAggregation.MAX
    )
    decision = await router.route(user("q"))
    assert len(decision.matches) == 3
    assert [m.utterance for m in decision.matches] == ["c", "w1", "w2"]
    assert decision.client is code
    assert decision.scores == {code: pytest.approx(0.9), writing: pytest.approx(0.8)}
    summed, _ = make_router(
        table, profiles, default, top_k=10, score_aggregation=ScoreAggregation.SUM
    )
    assert (await summed.route(user("q"))).client is writing


async def test_semantic_route_decision_fields() -> None:
    code, writing, default = NamedClient("code"), NamedClient("writing"), NamedClient("default")
    table = {"c": [1, 0], "w": [0.6, 0.8], "q": [1, 0]}
    router, _ = make_router(table, {code: ["c"], writing: ["w"]}, default, top_k=2)
    decision = await router.route(user("q"))
    assert decision.client is code and not decision.is_default
    assert decision.score == pytest.approx(1.0) and isinstance(decision.score, float)
    assert decision.winner is code and decision.threshold == 0.3
    assert decision.matches == (
        RouteMatch(client=code, utterance="c", score=1.0, profile_index=0),
        RouteMatch(client=writing, utterance="w", score=float(np.float32(0.6)), profile_index=1),
    )
    assert all(isinstance(m.score, float) for m in decision.matches)
    assert code.requests == [] and writing.requests == [] and default.requests == []


async def test_semantic_route_thresholds_override_global_threshold() -> None:
    code, writing, default = NamedClient("code"), NamedClient("writing"), NamedClient("default")
    table = {"c": [1, 0], "w": [0, 1], "qc": [3, -4], "qw": [-4, 3]}
    router, _ = make_router(
        table,
        {code: ["c"], writing: ["w"]},
        default,
        score_threshold=0.7,
        route_thresholds={code: 0.5},
    )
    to_code = await router.route(user("qc"))  # code scores 0.6: passes its own 0.5
    to_writing = await router.route(user("qw"))  # writing scores 0.6: fails the global 0.7
    assert to_code.client is code and to_code.threshold == 0.5
    assert to_writing.client is default and to_writing.winner is writing
    assert router.threshold_for(writing) == 0.7 and router.route_thresholds == {code: 0.5}
    with pytest.raises(ValueError):
        make_router(table, {code: ["c"]}, default, route_thresholds={writing: 0.5})
    with pytest.raises(ValueError):
        make_router(table, {code: ["c"]}, default, route_thresholds={code: 1.5})
    with pytest.raises(TypeError):
        make_router(table, {code: ["c"]}, default, route_thresholds={code: "x"})


# -- SR11, SR12: route and route_batch ------------------------------------------------------------


async def test_semantic_route_rejects_none_messages() -> None:
    router, _ = make_router({"c": [1, 0]}, {NamedClient("c"): ["c"]}, NamedClient("d"))
    with pytest.raises(TypeError):
        await router.route(None)  # type: ignore[arg-type]


async def test_semantic_route_batch_one_embedding_and_one_search(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    searches = count_searches(monkeypatch)
    code, writing, default = NamedClient("code"), NamedClient("writing"), NamedClient("default")
    table = {
        "c": [1, 0],
        "w": [0, 1],
        "to code": [0.9, 0.1],
        "to writing": [0.1, 0.9],
        "nowhere": [-1, -1],
        "zero": [0, 0],
    }
    router, gen = make_router(table, {code: ["c"], writing: ["w"]}, default, top_k=2)
    queries = ["to code", "  ", "to writing", "to code", "", "nowhere", "zero"]
    decisions = await router.route_batch(queries)
    assert gen.calls == [["c", "w"], ["to code", "to writing", "to code", "nowhere", "zero"]]
    assert searches == [5]
    assert [d.client for d in decisions] == [
        code,
        default,
        writing,
        code,
        default,
        default,
        default,
    ]
    assert [d.is_default for d in decisions] == [False, True, False, False, True, True, True]
    assert decisions[1] == decisions[4] == decisions[6] == RouteDecision(client=default)
    assert decisions[5].winner is not None and decisions[5].score is not None
    for query, decision in zip(queries, decisions, strict=True):
        assert await router.route(user(query)) == decision
    assert code.requests == [] and writing.requests == [] and default.requests == []


async def test_semantic_route_batch_empty_or_blank_calls_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    searches = count_searches(monkeypatch)
    default = NamedClient("default")
    router, gen = make_router({"c": [1, 0]}, {NamedClient("code"): ["c"]}, default)
    assert await router.route_batch([]) == []
    assert await router.route_batch(["", " ", "\n"]) == [RouteDecision(client=default)] * 3
    assert await router.route_batch(iter(["", " "])) == [RouteDecision(client=default)] * 2
    assert gen.calls == [] and searches == []
    assert router.profile_index is None


async def test_semantic_route_batch_rejects_bad_queries() -> None:
    router, gen = make_router({"c": [1, 0]}, {NamedClient("code"): ["c"]}, NamedClient("d"))
    for bad in (None, "a query", ["ok", None], ["ok", 3], [b"bytes"]):
        with pytest.raises(TypeError):
            await router.route_batch(bad)  # type: ignore[arg-type]
    assert gen.calls == []


async def test_semantic_route_batch_validates_embedding_count() -> None:
    router, gen = make_router(
        {"c": [1, 0], "q": [1, 0]}, {NamedClient("code"): ["c"]}, NamedClient("d")
    )
    await router.route_batch(["q"])
    gen.transform = lambda m: m[:1]
    with pytest.raises(RuntimeError, match="2 query embedding"):
        await router.route_batch(["q", "q"])


# -- SR14: dispatch -------------------------------------------------------------------------------


async def test_semantic_streaming_selects_once_on_first_item() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, gen = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    messages = user("q")
    stream = router.get_streaming_response(messages)
    assert gen.calls == []
    items = [update.text async for update in stream]
    assert items == ["code", "!"]
    assert gen.calls == [["c"], ["q"]]
    assert len(code.stream_requests) == 1 and code.stream_requests[0][0] is messages
    assert [u async for u in stream] == []
    assert gen.calls == [["c"], ["q"]]


async def test_semantic_dispatch_passes_context_messages_and_options() -> None:
    from chatroute.chat import ChatOptions

    code, default = NamedClient("code"), NamedClient("default")
    router, _ = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    messages = user("q")
    options = ChatOptions(temperature=0.5)
    await router.get_response(messages, options)
    ((sent_messages, sent_options),) = code.requests
    assert sent_messages is messages
    assert sent_options is not options and sent_options == options


async def test_semantic_get_service() -> None:
    router, _ = make_router({"c": [1, 0]}, {NamedClient("code"): ["c"]}, NamedClient("d"))
    assert router.get_service(SemanticRoutingChatClient) is router
    assert router.get_service(RoutingChatClient) is router
    assert router.get_service(SemanticRoutingChatClient, "key") is None
    assert router.get_service(NamedClient) is None
    with pytest.raises(TypeError):
        router.get_service(None)  # type: ignore[arg-type]


# -- SR15: closing ------------------------------------------------------------------------------


async def test_semantic_close_order_failures_and_leave_open() -> None:
    order: list[str] = []
    a, b, default = NamedClient("a"), NamedClient("b"), NamedClient("default")
    router, gen = make_router({"x": [1, 0]}, {a: ["x"], default: ["x"], b: ["x"]}, default)
    for client in (a, b, default):
        original = client.aclose

        async def record(client: NamedClient = client, original: Any = original) -> None:
            order.append(client.name)
            await original()

        client.aclose = record  # type: ignore[method-assign]
    first_error, second_error = ValueError("a fails"), RuntimeError("gen fails")
    a.close_error = first_error
    gen.close_error = second_error
    with pytest.raises(ValueError) as caught:
        await router.aclose()
    assert caught.value is first_error
    assert order == ["default", "a", "b"]
    assert (default.close_count, a.close_count, b.close_count, gen.close_count) == (1, 1, 1, 1)
    await router.aclose()
    assert gen.close_count == 1

    kept, kept_gen = make_router({"x": [1, 0]}, {a: ["x"]}, default, leave_open=True)
    await kept.aclose()
    assert kept_gen.close_count == 0 and a.close_count == 1 and default.close_count == 1


async def test_semantic_use_after_close_still_routes() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    router, _ = make_router({"c": [1, 0], "q": [1, 0]}, {code: ["c"]}, default)
    await router.aclose()
    assert (await router.get_response(user("q"))).text == "code"


# -- prebuilt index ------------------------------------------------------------------------------


async def test_semantic_uses_prebuilt_profile_index_without_profile_call() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    gen = FakeEmbeddingGenerator({"c": [1, 0], "q": [1, 0]}, fingerprint=FINGERPRINT)
    index = ProfileIndex([[1, 0]], utterances=["c"], fingerprint=FINGERPRINT)
    router = SemanticRoutingChatClient(gen, {code: ["c"]}, default, profile_index=index)
    assert (await router.route(user("q"))).client is code
    assert gen.calls == [["q"]]
    assert router.profile_index is index


async def test_semantic_rejects_mismatched_prebuilt_index() -> None:
    code, default = NamedClient("code"), NamedClient("default")
    gen = FakeEmbeddingGenerator({"c": [1, 0]}, fingerprint=FINGERPRINT)
    with pytest.raises(ValueError, match="rows"):
        SemanticRoutingChatClient(
            gen, {code: ["c"]}, default, profile_index=ProfileIndex([[1, 0], [0, 1]])
        )
    with pytest.raises(ValueError, match="utterances"):
        SemanticRoutingChatClient(
            gen, {code: ["c"]}, default, profile_index=ProfileIndex([[1, 0]], utterances=["x"])
        )
    other = EmbeddingFingerprint("other", "1" * 64, 2, True)
    with pytest.raises(FingerprintMismatchError):
        SemanticRoutingChatClient(
            gen, {code: ["c"]}, default, profile_index=ProfileIndex([[1, 0]], fingerprint=other)
        )
    with pytest.raises(TypeError):
        SemanticRoutingChatClient(gen, {code: ["c"]}, default, profile_index=[[1, 0]])  # type: ignore[arg-type]


async def test_semantic_torch_index_backend_gives_the_same_decisions() -> None:
    code, writing, default = NamedClient("code"), NamedClient("writing"), NamedClient("default")
    table = {"c": [1, 0], "w1": [0.8, 0.6], "w2": [0.8, -0.6], "q": [0.9, 0.1], "r": [0, 1]}
    profiles = {code: ["c"], writing: ["w1", "w2"]}
    faiss_router, _ = make_router(table, profiles, default, top_k=3)
    torch_router, _ = make_router(
        table, profiles, default, top_k=3, index_device="cpu", index_backend="torch"
    )
    queries = ["q", "r", "c", "w2"]
    via_faiss = await faiss_router.route_batch(queries)
    via_torch = await torch_router.route_batch(queries)
    for f, t in zip(via_faiss, via_torch, strict=True):
        assert (f.client, f.winner, f.is_default) == (t.client, t.winner, t.is_default)
        assert [m.profile_index for m in f.matches] == [m.profile_index for m in t.matches]
        assert f.score == pytest.approx(t.score, abs=1e-6)
        assert list(f.scores) == list(t.scores)
    assert faiss_router.profile_index is not None and torch_router.profile_index is not None
    assert (faiss_router.profile_index.backend, torch_router.profile_index.backend) == (
        "faiss",
        "torch",
    )


def test_semantic_index_device_follows_a_cuda_generator() -> None:
    from chatroute.router.semantic import _resolve_index_device

    gen = FakeEmbeddingGenerator({"c": [1, 0]})
    assert _resolve_index_device(None, gen) is None
    gen.device = "cpu"  # type: ignore[attr-defined]
    assert _resolve_index_device(None, gen) is None
    gen.device = "cuda:1"  # type: ignore[attr-defined]
    assert _resolve_index_device(None, gen) == "cuda:1"
    assert _resolve_index_device("cpu", gen) == "cpu"
