"""Request traces: the route chain's hook-based recording matches the generic TraceRecorder."""

from __future__ import annotations

from typing import Any

import pytest

from chatroute.errors import ProviderServerError
from chatroute.failover.health import HealthAwareFailoverChatClient
from chatroute.tracing import (
    RecordingFailoverChatClient,
    RequestTrace,
    TraceRecorder,
    end_trace,
    start_trace,
)
from tests.core_doubles import (
    FakeClient,
    collect,
    messages,
    raise_,
    response,
    returns,
    stream,
    stream_call_fails,
)


class GenericRecording(TraceRecorder, HealthAwareFailoverChatClient):
    """TraceRecorder's wrapping of select_client / on_routing_update, on the same policy."""

    def __init__(self, route: str, clients: list[FakeClient]) -> None:
        super().__init__(clients, names=[c.name for c in clients])
        self.route = route


def _clients() -> list[FakeClient]:
    busy = ProviderServerError("503 from upstream", provider="primary", status_code=503)
    primary = FakeClient(
        "primary",
        raise_(busy),
        returns(response("primary")),
        streams=[stream_call_fails(lambda: busy), stream("primary")],
    )
    fallback = FakeClient("fallback", returns(response("fallback")), streams=[stream("fb")])
    return [primary, fallback]


def _summary(trace: RequestTrace) -> list[Any]:
    return [
        trace.selections,
        [
            (r.route, r.provider, r.outcome, r.is_terminal, r.cancelled, r.probe, r.forced_probe)
            for r in trace.attempts
        ],
        [type(r.attempt.exception).__name__ for r in trace.attempts],
    ]


@pytest.mark.parametrize("streaming", [False, True])
async def test_the_route_chain_records_what_the_generic_recorder_records(streaming: bool) -> None:
    summaries = []
    for make in (
        lambda clients: GenericRecording("code", clients),
        lambda clients: RecordingFailoverChatClient("code", clients, [c.name for c in clients]),
    ):
        router = make(_clients())
        trace = start_trace("code")
        try:
            if streaming:
                assert await collect(router.get_streaming_response(messages())) == ["fb"]
            else:
                assert (await router.get_response(messages())).text == "fallback"
        finally:
            end_trace()
        summaries.append(_summary(trace))
    generic, chain = summaries
    assert chain == generic
    assert chain[0] == [("code", "primary"), ("code", "fallback")]
    assert [a[1:4] for a in chain[1]] == [
        ("primary", "failed", False),
        ("fallback", "success", True),
    ]


async def test_without_a_trace_nothing_is_recorded_and_routing_is_unchanged() -> None:
    clients = _clients()
    router = RecordingFailoverChatClient("code", clients, [c.name for c in clients])
    assert (await router.get_response(messages())).text == "fallback"
    assert [len(c.calls) for c in clients] == [1, 1]
