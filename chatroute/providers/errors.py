"""The provider errors under their older import path: a re-export of `chatroute.errors`."""

from chatroute.errors import *  # noqa: F403
from chatroute.errors import __all__ as __all__
