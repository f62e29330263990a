"""The exception hierarchy: every error ringcore raises on purpose.

``RingcoreError`` is the root. Bad arguments raise plain ``TypeError`` /
``ValueError`` before any byte is sent; the classes here describe what can go
wrong *between* ranks or in the configuration.
"""

from __future__ import annotations


class RingcoreError(RuntimeError):
    """Base class of every ringcore-specific error."""


class ConfigError(RingcoreError, ValueError):
    """A bad environment variable or ``init()`` argument; the message says which."""


class MismatchError(RingcoreError):
    """Ranks called the same collective with different arguments.

    Raised on every rank; the message names the ranks and the values that
    differ, e.g. ``allreduce #3: ranks disagree on count: rank 3 passed 1024,
    ranks 0-2 passed 1000``.
    """


class PeerFailure(RingcoreError, ConnectionError):
    """A peer died, closed its connection, or aborted the collective.

    Attributes:
        peer: the rank that failed (the root cause when it is known).
        host: that rank's ``host:port``, or ``""`` when unknown.
    """

    def __init__(self, message: str, peer: int = -1, host: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.host = host


class CollectiveTimeout(RingcoreError, TimeoutError):
    """No progress for ``RINGCORE_TIMEOUT`` seconds inside a collective."""


class AuthenticationError(RingcoreError, PermissionError):
    """A connection failed the HMAC handshake: the ranks do not share ``RINGCORE_SECRET``."""


class CommunicatorClosed(RingcoreError):
    """The communicator was shut down, or broken by an earlier failure."""
