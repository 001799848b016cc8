"""The ChatClient contract, and the delegating wrappers that compose behaviour around it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Self

from chatroute.chat.types import ChatMessage, ChatOptions, ChatResponse, ChatResponseUpdate

__all__ = ["ChatClient", "ConfigureOptionsChatClient", "DelegatingChatClient"]


class ChatClient(ABC):
    """Anything that answers chat requests: a provider, a router or a wrapper around one.

    Subclasses implement `get_response` and `get_streaming_response`. `aclose()` releases
    what the client owns and must be idempotent. Clients are compared by identity.
    """

    @abstractmethod
    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        """Send the messages and return the whole answer."""

    @abstractmethod
    def get_streaming_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        """Send the messages and return an async iterator of updates."""

    def get_service(self, service_type: type, key: object | None = None) -> object | None:
        """Return self when it is an instance of `service_type` and no key is given."""
        if service_type is None:
            raise TypeError("service_type must not be None")
        if key is None and isinstance(self, service_type):
            return self
        return None

    async def aclose(self) -> None:
        """Release owned resources; idempotent. The base owns nothing."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class DelegatingChatClient(ChatClient):
    """Forwards every call to `inner`; subclasses override what they change."""

    def __init__(self, inner: ChatClient) -> None:
        if inner is None:
            raise TypeError("inner must not be None")
        self.inner = inner

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        return await self.inner.get_response(messages, options)

    def get_streaming_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        return self.inner.get_streaming_response(messages, options)

    def get_service(self, service_type: type, key: object | None = None) -> object | None:
        found = super().get_service(service_type, key)
        return found if found is not None else self.inner.get_service(service_type, key)

    async def aclose(self) -> None:
        await self.inner.aclose()


class ConfigureOptionsChatClient(DelegatingChatClient):
    """Applies `configure` to a clone of the request options (or new ones) before forwarding.

    The caller's options object is never modified, so route-level overrides never leak
    into the request context or into other routes.
    """

    def __init__(self, inner: ChatClient, configure: Callable[[ChatOptions], None]) -> None:
        super().__init__(inner)
        if configure is None:
            raise TypeError("configure must not be None")
        if not callable(configure):
            raise TypeError("configure must be callable")
        self.configure = configure

    def _options(self, options: ChatOptions | None) -> ChatOptions:
        opts = options.clone() if options is not None else ChatOptions()
        self.configure(opts)
        return opts

    async def get_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> ChatResponse:
        return await self.inner.get_response(messages, self._options(options))

    def get_streaming_response(
        self, messages: Sequence[ChatMessage], options: ChatOptions | None = None
    ) -> AsyncIterator[ChatResponseUpdate]:
        return self.inner.get_streaming_response(messages, self._options(options))
