"""Reusable scratch buffers, kept per transport and array backend so repeated calls allocate
nothing new."""
from __future__ import annotations

from typing import Any

import numpy as np


class Workspace:
    """Named byte buffers of one array backend (``xp``: numpy or cupy) that grow to the largest
    size asked for and are then reused.

    A view handed out is valid until the next ``get`` of the same name; results returned to the
    caller never live here.
    """

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp
        self._buffers: dict[str, Any] = {}

    def get(self, name: str, nbytes: int) -> Any:
        """A uint8 view of ``nbytes`` bytes of the buffer called ``name``."""
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[name] = self.xp.empty(max(nbytes, 64), np.uint8)
        return buf[:nbytes]

    def nbytes(self) -> int:
        """Total bytes held."""
        return sum(int(b.size) for b in self._buffers.values())


def workspace_of(transport: Any, xp: Any = np) -> Workspace:
    """The workspace of backend ``xp`` kept in a transport's state (created on first use)."""
    spaces = transport.state.workspaces
    ws = spaces.get(xp.__name__)
    if ws is None:
        ws = spaces[xp.__name__] = Workspace(xp)
    return ws
