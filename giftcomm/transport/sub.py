"""A transport over a subset of another transport's ranks (for the hierarchical algorithm).

Point-to-point messages go through the parent with ranks translated and tags moved into a range
of their own, so the subgroup's traffic never matches the parent's or a sibling subgroup's.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .base import Request, Transport, wait_all

TAG_SPAN = 4096  # tags a subgroup may use; hop indices stay far below it


class SubTransport(Transport):
    """Ranks ``members`` of ``parent`` (in that order) as a transport of ``len(members)`` ranks."""

    def __init__(self, parent: Transport, members: Sequence[int], tag_base: int) -> None:
        self.parent = parent
        self.members = [int(m) for m in members]
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)
        self.tag_base = tag_base
        self.schedule, self.memory = parent.schedule, parent.memory

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        return self.parent.isend(buf, self.members[dest], self.tag_base + tag)

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        return self.parent.irecv(buf, self.members[source], self.tag_base + tag)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        """Ring allgather over point-to-point (control path: a few int64 per rank)."""
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        table = np.empty((self.size, vec.size), np.int64)
        table[self.rank] = vec
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        for step in range(self.size - 1):
            send_row, recv_row = (self.rank - step) % self.size, (self.rank - step - 1) % self.size
            reqs = [self.irecv(table[recv_row], left, TAG_SPAN - 1), self.isend(table[send_row], right, TAG_SPAN - 1)]
            wait_all(reqs)
        return table

    def allgather_object(self, obj: Any) -> list[Any]:
        raise NotImplementedError("subgroup transports carry data only; errors are agreed on the parent")
