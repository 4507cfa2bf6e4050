"""Reusable scratch buffers, kept per transport so repeated calls allocate nothing new."""
from __future__ import annotations

import numpy as np


class Workspace:
    """Named byte buffers that grow to the largest size asked for and are then reused.

    A view handed out is valid until the next ``get`` of the same name; results returned to the
    caller never live here.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, nbytes: int) -> np.ndarray:
        """A uint8 view of ``nbytes`` bytes of the buffer called ``name``."""
        buf = self._buffers.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[name] = np.empty(max(nbytes, 64), np.uint8)
        return buf[:nbytes]

    def nbytes(self) -> int:
        """Total bytes held."""
        return sum(b.size for b in self._buffers.values())


def workspace_of(transport: object) -> Workspace:
    """The workspace attached to a transport (created on first use)."""
    ws = getattr(transport, "_giftcomm_workspace", None)
    if ws is None:
        ws = Workspace()
        setattr(transport, "_giftcomm_workspace", ws)
    return ws
