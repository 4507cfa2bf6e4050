"""The torch.distributed ``Work`` objects the torch adapters' collectives return: a completed one
once giftcomm's call has run (the one place that reaches torch's private
``_create_work_from_future``, which torch's type stubs do not declare), and a pending one whose
``wait()`` blocks until a call queued on a worker thread has run and raises that call's error."""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["completed_work", "PendingWork"]


def completed_work(tensors: list[torch.Tensor]) -> dist.Work:
    """A ``Work`` that has finished, whose ``wait()`` returns True and whose future holds
    ``tensors`` (the collective's outputs)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensors)
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


class PendingWork(dist.Work):
    """A ``Work`` of a call running on a worker thread: ``fut`` (a ``torch.futures.Future``)
    gets the call's outputs, or its exception, when it ends. ``wait()`` blocks until then and
    raises that exception (a completed-from-future ``Work`` would return True and drop it);
    ``get_future()`` is ``fut``. The worker's waits are bounded by giftcomm's call timeout, so
    ``wait()`` returns or raises within it."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: object = None) -> bool:  # type: ignore[override]
        self._fut.wait()  # raises the call's exception
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001 - the call failed: wait() raises it
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut
