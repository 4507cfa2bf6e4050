"""Transport over a torch.distributed process group (for users who already have one).

Messages are host (CPU) ``torch.uint8`` tensors that share memory with the NumPy buffers
(``torch.from_numpy``), so nothing is copied on our side. Point-to-point traffic goes through a
*private* gloo group over the same ranks, created when the transport is built (a collective
call, like ``MPI_Comm_dup``): our tags never meet the caller's messages, and the transport works
whatever the backend of the caller's group is (gloo, or NCCL whose tensors must live on a GPU,
while giftcomm's wire messages are host buffers).
"""
from __future__ import annotations

import socket
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .base import Request, Transport

__all__ = ["TorchDistTransport"]


class _TorchRequest(Request):
    __slots__ = ("_work", "_keep")

    def __init__(self, work, keep: Any) -> None:
        self._work, self._keep = work, keep  # keep the tensor alive until the wait

    def wait(self) -> None:
        self._work.wait()
        self._keep = None


def _as_tensor(buf: np.ndarray) -> torch.Tensor:
    """A uint8 CPU tensor sharing memory with the contiguous NumPy array ``buf``."""
    flat = buf.reshape(-1).view(np.uint8)
    if not flat.flags.writeable:  # torch.from_numpy warns on read-only arrays; we only read them
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(flat)
    return torch.from_numpy(flat)


class TorchDistTransport(Transport):
    """A giftcomm Transport over the ranks of ``group`` (default: the default process group).

    Building one is collective over ``group`` (it creates the private gloo group). ``rank`` and
    ``size`` are the ranks within ``group``. torch.distributed must already be initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, backend: str = "gloo") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistTransport needs an initialised torch.distributed (init_process_group)")
        self.user_group = group
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self._global = list(ranks)
        self.group = dist.new_group(ranks=self._global, backend=backend)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self._nodes = self._find_nodes()

    def _find_nodes(self) -> np.ndarray:
        """Node index per rank: ranks reporting the same host name share a node; nodes are
        numbered in the order of their lowest rank (collective; done once, at creation)."""
        hosts = self.allgather_object(socket.gethostname())
        leader = {h: min(r for r, x in enumerate(hosts) if x == h) for h in hosts}
        leaders = np.array([leader[h] for h in hosts], np.int64)
        return np.unique(leaders, return_inverse=True)[1].astype(np.int64)

    def node_ids(self) -> np.ndarray:
        """Node index of every rank (int64, shape (size,)), from the ranks' host names."""
        return self._nodes.copy()

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        t = _as_tensor(buf)
        return _TorchRequest(dist.isend(t, self._global[dest], group=self.group, tag=tag), t)

    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        t = _as_tensor(buf)
        return _TorchRequest(dist.irecv(t, self._global[source], group=self.group, tag=tag), t)

    def allgather_int64(self, vec: np.ndarray) -> np.ndarray:
        mine = torch.from_numpy(np.array(vec, dtype=np.int64, copy=True).reshape(-1))
        table = torch.empty((self.size, mine.numel()), dtype=torch.int64)
        dist.all_gather(list(table.unbind(0)), mine, group=self.group)
        return table.numpy()

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def free(self) -> None:
        """Destroy the private group (optional; torch frees it at destroy_process_group)."""
        dist.destroy_process_group(self.group)
