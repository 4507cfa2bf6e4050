"""A collective call's turn on its transport: :class:`held`, shared by the plain calls
(giftcomm.collectives.engine) and the persistent plans (giftcomm.plans.persistent), which both build
on it and on nothing of each other's.
"""
from __future__ import annotations

from ..errors import CommClosed
from ..transport import Transport
from ..transport.channel import PLAIN_WORD
from .agree import meet_plans
from .call import caller

__all__ = ["held"]


class held:
    """Hold ``t`` for one call (calls from several threads run one at a time; docs/api.md,
    Threads), with its waits' deadline set to ``timeout`` seconds when given. A transport whose
    state was closed meanwhile (giftcomm.release) gives a fresh state; one gone for good (its
    communicator freed, a forked child) raises CommClosed. ``plain``: a plain call (not a plan's),
    which meets the plans in their channel when the transport has one, so that a plan on one rank
    and a plain call on another raise "ranks disagree" on both at once."""

    __slots__ = ("_t", "_timeout", "_previous", "_lock", "_plain")

    def __init__(self, t: Transport, timeout: float | None, plain: bool = True) -> None:
        self._t, self._timeout, self._plain = t, timeout, plain
        self._previous: float = 0.0

    def __enter__(self) -> None:
        t = self._t
        while True:
            st = t.state
            st.lock.acquire()
            if st.closed is None:
                break
            st.lock.release()
            if t._state is st:  # closed for good: the state stays attached
                raise CommClosed(st.closed)
        self._lock = st.lock
        try:
            if self._timeout is not None:
                self._previous, t.timeout = t.timeout, self._timeout
            if self._plain and st.channel is not None:
                meet_plans(t, st.channel, PLAIN_WORD, caller(), "giftcomm")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        if self._timeout is not None:
            self._t.timeout = self._previous
        self._lock.release()
