"""Context policies: conversation-aware decisions, their cache, and bad conversations."""

from __future__ import annotations

import numpy as np
import pytest

from chatroute import (
    ChatMessage,
    ChatRole,
    ConversationDecision,
    ConversationPolicy,
    LastUserPolicy,
    SemanticRoutingChatClient,
)
from chatroute.router.conversation import (
    DEFAULT_TEMPERATURES,
    FALLBACK_TEMPERATURE,
    context_policy,
)
from chatroute.router.decision import ScoreAggregation
from tests.core_doubles import messages as one_message
from tests.semantic_doubles import FakeEmbeddingGenerator, NamedClient

HOTEL = [1.0, 0.0, 0.0]
FOOD = [0.0, 1.0, 0.0]
VAGUE = [0.0, 0.0, 1.0]

U = ChatRole.USER
A = ChatRole.ASSISTANT


def _vector(*parts: tuple[list[float], float]) -> list[float]:
    return [sum(weight * vec[i] for vec, weight in parts) for i in range(3)]


TABLE = {
    "book a hotel room": HOTEL,
    "find me a restaurant": FOOD,
    "book a hotel room\nWhich hotel do you want?": HOTEL,
    # The follow-up alone says nothing of its domain ...
    "yes, for two nights": _vector((VAGUE, 1.0), (FOOD, 0.5)),
    # ... read with the assistant's question before it, it is a hotel turn.
    "yes, for two nights\nWhich hotel do you want?": _vector((HOTEL, 0.7), (VAGUE, 0.7)),
    # A clear switch, read with the assistant's hotel answer.
    "find me a restaurant\nBooked the Ritz.": _vector((FOOD, 0.9), (HOTEL, 0.3)),
    # A faint pull towards food: food wins the turn, by too little to pay for a move.
    "something to eat nearby?\nBooked the Ritz.": _vector((HOTEL, 0.3), (FOOD, 0.32), (VAGUE, 0.9)),
    # A vague turn that leans to food enough to move on its own ...
    "what about dinner?\nBooked the Ritz.": _vector((HOTEL, 0.45), (FOOD, 0.6), (VAGUE, 0.66)),
    # ... and one that leans back to hotel, by too little to move on its own.
    "is breakfast included?\nAnything else?": _vector((HOTEL, 0.4), (FOOD, 0.38), (VAGUE, 0.834)),
}


def _router(
    **kw: object,
) -> tuple[SemanticRoutingChatClient, FakeEmbeddingGenerator, dict[str, NamedClient]]:
    gen = FakeEmbeddingGenerator(TABLE)
    clients = {name: NamedClient(name) for name in ("default", "hotel", "food")}
    router = SemanticRoutingChatClient(
        gen,
        {clients["hotel"]: ["book a hotel room"], clients["food"]: ["find me a restaurant"]},
        clients["default"],
        **kw,  # type: ignore[arg-type]
    )
    return router, gen, clients


def _chat(*turns: tuple[ChatRole, str]) -> list[ChatMessage]:
    return [ChatMessage(role, text) for role, text in turns]


HOTEL_CHAT = [(U, "book a hotel room"), (A, "Which hotel do you want?"), (U, "yes, for two nights")]
RITZ = [(U, "book a hotel room"), (A, "Booked the Ritz.")]


async def test_last_user_is_the_library_default_and_reads_the_last_message_alone() -> None:
    router, _, clients = _router()
    assert isinstance(router.context, LastUserPolicy)
    decision = await router.route(_chat(*HOTEL_CHAT))
    assert decision.client is clients["food"]  # the follow-up alone leans to food
    assert not isinstance(decision, ConversationDecision)


async def test_a_follow_up_stays_on_the_conversations_route() -> None:
    router, gen, clients = _router(context="conversation")
    decision = await router.route(_chat(*HOTEL_CHAT))
    assert isinstance(decision, ConversationDecision)
    assert decision.client is clients["hotel"]
    assert decision.outcome == "kept"
    assert decision.conversation_client is clients["hotel"]
    assert decision.conversation_score == pytest.approx(0.7071, abs=1e-3)
    assert decision.turns_read == 2
    # the user's words come first, then the assistant text before them
    assert gen.calls[-1] == ["book a hotel room", "yes, for two nights\nWhich hotel do you want?"]
    # and chat requests go where the decision says
    answer = await router.get_response(_chat(*HOTEL_CHAT))
    assert answer.text == "hotel"


async def test_a_clear_switch_moves_and_a_faint_one_does_not() -> None:
    router, _, clients = _router(context="conversation")
    moved = await router.route(_chat(*RITZ, (U, "find me a restaurant")))
    assert isinstance(moved, ConversationDecision)
    assert (moved.client, moved.outcome) == (clients["food"], "switched")
    assert moved.challenger_client is clients["food"]
    assert moved.conversation_client is clients["hotel"]
    assert moved.challenger_score is not None and moved.conversation_score is not None
    assert moved.challenger_score > moved.conversation_score
    stayed = await router.route(_chat(*RITZ, (U, "something to eat nearby?")))
    assert isinstance(stayed, ConversationDecision)
    assert (stayed.client, stayed.outcome) == (clients["hotel"], "kept")
    assert stayed.winner is clients["food"]  # food won the turn, not by enough to move


async def test_a_move_on_a_vague_turn_is_undone_when_the_next_turn_leans_back() -> None:
    router, _, clients = _router(context="conversation")
    vague = [*RITZ, (U, "what about dinner?")]
    moved = await router.route(_chat(*vague))
    assert isinstance(moved, ConversationDecision)
    assert (moved.client, moved.outcome) == (clients["food"], "switched")
    lean = [(A, "Anything else?"), (U, "is breakfast included?")]
    back = await router.route(_chat(*vague, *lean))
    assert isinstance(back, ConversationDecision)
    # Staying on hotel all along now beats having moved at the vague turn ...
    assert back.client is clients["hotel"]
    assert (back.outcome, back.conversation_client) == ("switched", clients["food"])
    # ... while the same lean, in a conversation that was on food from its start, moves
    # nothing: it is the history that brings the hotel back.
    on_food = await router.route(_chat((U, "find me a restaurant"), *lean))
    assert (on_food.client, on_food.winner) == (clients["food"], clients["hotel"])


async def test_the_switch_parameters_decide_how_easily_a_conversation_moves() -> None:
    async def routed(policy: ConversationPolicy, *turns: tuple[ChatRole, str]) -> str:
        router, _, _ = _router(context=policy)
        return (await router.route(_chat(*turns))).client.name  # type: ignore[attr-defined,no-any-return]

    switch = (*RITZ, (U, "find me a restaurant"))
    faint = (*RITZ, (U, "something to eat nearby?"))
    assert await routed(ConversationPolicy(), *switch) == "food"
    assert await routed(ConversationPolicy(switch_share=1.0), *switch) == "hotel"  # none takes all
    assert await routed(ConversationPolicy(switch_cost=5.0), *switch) == "hotel"
    assert await routed(ConversationPolicy(), *faint) == "hotel"
    assert await routed(ConversationPolicy(switch_cost=0.0), *faint) == "food"


async def test_an_opening_turn_is_decided_as_a_single_message() -> None:
    router, _, clients = _router(context="conversation")
    single, _, _ = _router()
    for text in ("book a hotel room", "yes, for two nights", "find me a restaurant"):
        decision = await router.route(_chat((U, text)))
        alone = await single.route(_chat((U, text)))
        assert isinstance(decision, ConversationDecision) and decision.outcome == "new"
        assert decision.client.name == alone.client.name  # type: ignore[attr-defined]
        assert decision.score == pytest.approx(alone.score)
    strict, _, clients = _router(context="conversation", score_threshold=0.95)
    below = await strict.route(_chat((U, "yes, for two nights")))
    assert below.client is clients["default"] and below.is_default


async def test_the_temperature_follows_the_scoring_mode_unless_given() -> None:
    policy = ConversationPolicy()
    top_k, _, _ = _router()
    prototype, _, _ = _router(scoring="prototype")
    assert policy.temperature_for(top_k) == DEFAULT_TEMPERATURES["top_k"]
    assert policy.temperature_for(prototype) == DEFAULT_TEMPERATURES["prototype"]
    assert policy.temperature_for(object()) == FALLBACK_TEMPERATURE  # type: ignore[arg-type]
    assert ConversationPolicy(temperature=0.2).temperature_for(prototype) == 0.2


async def test_sum_aggregation_decides_as_mean_does() -> None:
    chats = [
        _chat(*HOTEL_CHAT),
        _chat(*RITZ, (U, "find me a restaurant")),
        _chat(*RITZ, (U, "something to eat nearby?")),
        _chat(*RITZ, (U, "what about dinner?")),
    ]
    decided = {}
    for aggregation in (ScoreAggregation.MEAN, ScoreAggregation.SUM):
        gen = FakeEmbeddingGenerator({**TABLE, "a hotel room please": HOTEL, "a table": FOOD})
        clients = {name: NamedClient(name) for name in ("default", "hotel", "food")}
        router = SemanticRoutingChatClient(
            gen,
            {
                clients["hotel"]: ["book a hotel room", "a hotel room please"],
                clients["food"]: ["find me a restaurant", "a table"],
            },
            clients["default"],
            top_k=2,
            score_aggregation=aggregation,
            context="conversation",
        )
        decisions = await router.route_conversations(chats)
        decided[aggregation] = [(d.client.name, d.outcome) for d in decisions]  # type: ignore[attr-defined]
    assert decided[ScoreAggregation.MEAN] == decided[ScoreAggregation.SUM]
    assert [name for name, _ in decided[ScoreAggregation.SUM]] == [
        "hotel",
        "food",
        "hotel",
        "food",
    ]


async def test_earlier_turns_are_scored_once_across_requests_and_batches() -> None:
    router, gen, _ = _router(context="conversation")
    await router.route(_chat(*HOTEL_CHAT[:1]))
    await router.route(_chat(*HOTEL_CHAT))
    assert gen.calls[-1] == ["yes, for two nights\nWhich hotel do you want?"]
    before = len(gen.calls)
    food = _chat((U, "find me a restaurant"))
    decisions = await router.route_conversations([_chat(*HOTEL_CHAT), food, food])
    assert len(decisions) == 3
    assert gen.calls[before:] == [["find me a restaurant"]]  # one call, only the new text


async def test_only_the_last_window_of_turns_is_read() -> None:
    policy = ConversationPolicy(window=2)
    router, gen, _ = _router(context=policy)
    long = []
    for _ in range(500):
        long += [(U, "book a hotel room"), (A, "Which hotel do you want?")]
    long.append((U, "yes, for two nights"))
    decision = await router.route(_chat(*long))
    assert isinstance(decision, ConversationDecision) and decision.turns_read == 2
    assert sum(len(call) for call in gen.calls[1:]) == 2


@pytest.mark.parametrize(
    "conversation",
    [
        [],
        [(ChatRole.SYSTEM, "you are helpful")],
        [(ChatRole.TOOL, "42"), (A, "done")],
        [(U, "   "), (A, "hello")],
    ],
)
async def test_a_conversation_without_a_user_turn_gets_the_default_route(
    conversation: list[tuple[ChatRole, str]],
) -> None:
    router, gen, clients = _router(context="conversation")
    decision = await router.route(_chat(*conversation))
    assert decision.client is clients["default"] and decision.is_default
    assert gen.calls == []


async def test_tool_messages_and_tool_call_turns_are_skipped() -> None:
    router, _, clients = _router(context="conversation")
    chat = _chat(
        (U, "book a hotel room"),
        (A, "Which hotel do you want?"),
        (A, ""),  # a tool call's message, no visible text
        (ChatRole.TOOL, "{}"),
        (U, "yes, for two nights"),
    )
    decision = await router.route(chat)
    assert decision.client is clients["hotel"]


def test_policy_names_and_bad_parameters() -> None:
    assert isinstance(context_policy(None), LastUserPolicy)
    assert isinstance(context_policy("conversation"), ConversationPolicy)
    with pytest.raises(ValueError, match="unknown context policy"):
        context_policy("history")
    with pytest.raises(TypeError):
        context_policy(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        ConversationPolicy(window=0)
    with pytest.raises(ValueError, match="switch_cost"):
        ConversationPolicy(switch_cost=float("nan"))
    with pytest.raises(ValueError, match="switch_share"):
        ConversationPolicy(switch_share=1.5)
    with pytest.raises(ValueError, match="temperature"):
        ConversationPolicy(temperature=0.0)
    with pytest.raises(TypeError, match="match_weight"):
        ConversationPolicy(match_weight="0.5")  # type: ignore[arg-type]


async def test_route_conversations_refuses_a_bare_string() -> None:
    router, _, _ = _router(context="conversation")
    with pytest.raises(TypeError, match="conversation 0"):
        await router.route_conversations(["hello"])  # type: ignore[list-item]
    assert len(one_message()) == 1


def test_dense_route_scores_aggregate_each_routes_own_best_hits() -> None:

    from chatroute.router.route_scores import RouteGather, dense_route_scores

    # rows 0-2 belong to route 1, row 3 to route 2; route 0 (the default) has none
    gather = RouteGather([1, 1, 1, 2], 3)
    sims = np.array([[0.9, 0.1, 0.5, 0.4]], dtype=np.float32)
    mean = dense_route_scores(sims, gather, 2, ScoreAggregation.MEAN)[0]
    assert mean[0] == -np.inf
    assert mean[1] == pytest.approx(0.7) and mean[2] == pytest.approx(0.4)  # 1 of 2 taken
    total = dense_route_scores(sims, gather, 2, ScoreAggregation.SUM)[0]
    assert total[1] == pytest.approx(1.4) and total[2] == pytest.approx(0.4)
    best = dense_route_scores(sims, gather, 3, ScoreAggregation.MAX)[0]
    assert best[1] == pytest.approx(0.9)


async def test_score_routes_agrees_with_a_single_message_decision() -> None:
    router, _, clients = _router()
    [(scores, matches)] = await router.score_routes(["yes, for two nights"])
    decision = await router.route(_chat((U, "yes, for two nights")))
    assert router.clients[int(scores.argmax())] is decision.winner is clients["food"]
    assert matches == decision.matches
    [(blank, none)] = await router.score_routes(["  "])
    assert none == () and not any(np.isfinite(blank))
