"""Errors a transport raises when the ranks stop making progress together.

- :class:`CommTimeout` (a :class:`TimeoutError`): a blocking wait (a message, an agreement
  gather, a shared-window fence, the creation of a private communicator) passed its deadline,
  ``Transport.timeout`` seconds (default ``$GIFTCOMM_TIMEOUT``, 600; 0: no deadline). It names
  the operation, this rank and the peers it was waiting for.
- :class:`CommAborted`: the transport was left unusable by an earlier timeout or interrupt (its
  messages may still be in flight, so its buffers can no longer be trusted); every later call on
  it raises this at once, naming the first failure.
- :class:`CommClosed` (a :class:`CommAborted`): what the object was used through is gone -- its
  communicator was freed, :func:`giftcomm.release` released it, or this process is a fork()ed
  child of the one that created it. A persistent plan, a transport or its plan channel raises
  it at once, on every rank that uses it, instead of waiting or reaching into freed MPI state.

What happens at the deadline is ``$GIFTCOMM_ON_TIMEOUT`` (docs/robustness.md): ``abort``
(default; MPI transports) prints the message to stderr and calls ``MPI_Abort`` so that the whole
job ends in bounded time; ``raise`` raises :class:`CommTimeout` and marks the transport unusable.
"""
from __future__ import annotations

__all__ = ["CommError", "CommTimeout", "CommAborted", "CommClosed"]


class CommError(Exception):
    """Base of giftcomm's communication failures (not argument errors)."""


class CommTimeout(CommError, TimeoutError):
    """A wait passed its deadline. ``operation``: what was waited for; ``peers``: the ranks
    (of the transport) it waited for; ``seconds``: the deadline; ``rank``: this rank."""

    def __init__(self, message: str, operation: str = "", peers: tuple[int, ...] = (), seconds: float = 0.0,
                 rank: int = -1) -> None:
        super().__init__(message)
        self.operation, self.peers, self.seconds, self.rank = operation, tuple(peers), seconds, rank


class CommAborted(CommError, RuntimeError):
    """The transport is unusable after an earlier timeout or interrupt."""


class CommClosed(CommAborted):
    """The communicator (or transport) this object belongs to was freed or released, or this is
    a fork()ed child of the process that created it: make a new communicator (and plan)."""
