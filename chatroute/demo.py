"""A self-contained demo: an ordered failover chain of in-process clients and its attempts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from chatroute.chat import (
    ChatClient,
    ChatMessage,
    ChatOptions,
    ChatResponse,
    ChatResponseUpdate,
    ChatRole,
    TextContent,
)
from chatroute.failover import FailoverChatClientAttempt, OrderedFailoverChatClient
from chatroute.router import RoutingContext

__all__ = ["main", "run_demo"]


class ServiceUnavailableError(RuntimeError):
    """A 503-like provider error."""

    status_code = 503


class DemoClient(ChatClient):
    """Base of the demo clients: a name, a call counter and a canned answer."""

    def __init__(self, name: str, latency: float) -> None:
        self.name = name
        self.latency = latency
        self.calls = 0

    def answer(self, messages: Sequence[ChatMessage]) -> str:
        question = messages[-1].text if messages else ""
        return f"[{self.name}] you asked: {question!r}"

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        self.calls += 1
        await asyncio.sleep(self.latency)
        self.before_output(self.calls)
        return ChatResponse(
            messages=[ChatMessage(ChatRole.ASSISTANT, self.answer(messages))],
            model_id=self.name,
        )

    async def get_streaming_response(  # type: ignore[override]
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        self.calls += 1
        call = self.calls
        await asyncio.sleep(self.latency)
        self.before_output(call)
        for index, word in enumerate(self.answer(messages).split(" ")):
            await asyncio.sleep(self.latency / 4)
            self.during_output(call, index)
            yield ChatResponseUpdate(
                role=ChatRole.ASSISTANT, contents=[TextContent(word + " ")], model_id=self.name
            )

    def before_output(self, call: int) -> None:
        """Raise here to fail before anything reaches the caller."""

    def during_output(self, call: int, index: int) -> None:
        """Raise here to fail after output was committed."""


class UnavailableClient(DemoClient):
    """Always answers 503."""

    def before_output(self, call: int) -> None:
        raise ServiceUnavailableError("503 Service Unavailable")


class FlakyClient(DemoClient):
    """Fails on every other call; on some streaming calls it breaks off mid-stream."""

    def before_output(self, call: int) -> None:
        if call % 2 == 1:
            raise ConnectionResetError("connection reset by peer")

    def during_output(self, call: int, index: int) -> None:
        if call % 4 == 0 and index == 3:
            raise ConnectionResetError("stream cut after 3 updates")


class HealthyClient(DemoClient):
    """Always answers."""


@dataclass
class AttemptRow:
    """One attempt record, with the request it belongs to."""

    request: int
    mode: str
    attempt: FailoverChatClientAttempt
    is_terminal: bool


class RecordingOrderedFailover(OrderedFailoverChatClient):
    """An ordered failover chain that keeps every attempt record for display."""

    def __init__(self, clients: Sequence[ChatClient]) -> None:
        super().__init__(clients)
        self.rows: list[AttemptRow] = []
        self.request = 0
        self.mode = ""

    async def on_routing_update(
        self, context: RoutingContext, attempt: FailoverChatClientAttempt, is_terminal: bool
    ) -> None:
        self.rows.append(AttemptRow(self.request, self.mode, attempt, is_terminal))
        await super().on_routing_update(context, attempt, is_terminal)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def attempts_table(rows: Sequence[AttemptRow]) -> Table:
    """The attempt records as a table."""
    table = Table(title="Attempt records (ms = active time)")
    table.add_column("req", justify="right", no_wrap=True)
    table.add_column("mode", no_wrap=True)
    table.add_column("client", no_wrap=True)
    table.add_column("duration ms", justify="right", no_wrap=True)
    table.add_column("first update ms", justify="right", no_wrap=True)
    table.add_column("committed", justify="center", no_wrap=True)
    table.add_column("completed", justify="center", no_wrap=True)
    table.add_column("terminal", justify="center", no_wrap=True)
    table.add_column("outcome", overflow="fold")
    for row in rows:
        attempt = row.attempt
        if attempt.exception is not None:
            error = f"{type(attempt.exception).__name__}: {attempt.exception}"
            outcome = f"[red]{escape(error)}[/red]"
        elif attempt.response_completed:
            outcome = "[green]ok[/green]"
        else:
            outcome = "[yellow]stopped by caller[/yellow]"
        table.add_row(
            str(row.request),
            row.mode,
            escape(getattr(attempt.client, "name", type(attempt.client).__name__)),
            _ms(attempt.duration),
            _ms(attempt.time_to_first_update),
            "yes" if attempt.output_committed else "no",
            "yes" if attempt.response_completed else "no",
            "yes" if row.is_terminal else "no",
            outcome,
        )
    return table


async def run_demo(console: Console) -> RecordingOrderedFailover:
    """Route a few messages through [unavailable, flaky, healthy] and print what happened."""
    unavailable = UnavailableClient("primary-503", latency=0.004)
    flaky = FlakyClient("flaky-backup", latency=0.006)
    healthy = HealthyClient("healthy-backup", latency=0.008)
    router = RecordingOrderedFailover([unavailable, flaky, healthy])
    console.print(
        "[bold]chatroute demo[/bold]: OrderedFailoverChatClient over "
        + escape(f"[{unavailable.name}, {flaky.name}, {healthy.name}]")
        + " (in-process clients, no network)\n"
    )

    questions = [
        "What is a semantic router?",
        "How does failover work?",
        "When is output committed?",
    ]
    async with router:
        for question in questions:
            router.request += 1
            router.mode = "response"
            messages = [ChatMessage(ChatRole.USER, question)]
            response = await router.get_response(messages)
            console.print(f"[cyan]#{router.request} response[/cyan] {escape(response.text)}")

        for question in ["Stream me an answer.", "Stream another one.", "And one more."]:
            router.request += 1
            router.mode = "stream"
            messages = [ChatMessage(ChatRole.USER, question)]
            console.print(f"[cyan]#{router.request} stream[/cyan] ", end="")
            try:
                async for update in router.get_streaming_response(messages):
                    console.print(escape(update.text), end="")
                console.print()
            except ConnectionResetError as exc:
                # after output was committed nothing fails over: the caller sees the error
                console.print(f"\n   [red]stream failed after output: {escape(str(exc))}[/red]")

    console.print()
    console.print(attempts_table(router.rows))
    console.print(
        "Failures before any output moved to the next client; a failure after output "
        "was committed is terminal and reaches the caller. Durations count active "
        "time only."
    )
    return router


def main() -> None:
    """Entry point of `python -m chatroute.demo`."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # piped output: room for the whole table
    asyncio.run(run_demo(console))


if __name__ == "__main__":
    main()
