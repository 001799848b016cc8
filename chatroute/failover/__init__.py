"""Failover: routers that move a request to another client when an attempt fails before output."""

from chatroute.failover.attempt import FailoverChatClientAttempt
from chatroute.failover.base import FailoverChatClient
from chatroute.failover.ordered import OrderedFailoverChatClient

__all__ = ["FailoverChatClient", "FailoverChatClientAttempt", "OrderedFailoverChatClient"]
