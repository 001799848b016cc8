"""Failover: routers that move a request to another client when an attempt fails before output."""

from chatroute.failover.attempt import FailoverChatClientAttempt
from chatroute.failover.base import FailoverChatClient
from chatroute.failover.health import HealthAwareFailoverChatClient, Selection
from chatroute.failover.ordered import OrderedFailoverChatClient
from chatroute.failover.timeouts import DeadlineExceededError, TimeoutChatClient

__all__ = [
    "DeadlineExceededError",
    "FailoverChatClient",
    "FailoverChatClientAttempt",
    "HealthAwareFailoverChatClient",
    "OrderedFailoverChatClient",
    "Selection",
    "TimeoutChatClient",
]
