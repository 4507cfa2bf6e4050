"""Lightning integration (needs ``lightning`` or ``pytorch_lightning``, and ``torch``): a Callback
that puts giftcomm's DDP communication hook on the model Lightning wraps, on any device.

::

    from giftcomm.adapters.lightning import GiftCommCallback

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[GiftCommCallback(fmt="e4m3", schedule=GiftSchedule(warmup=10))])

Lightning's own route, ``DDPStrategy(ddp_comm_state=GiftState(...), ddp_comm_hook=gift_hook)``,
registers the hook only when the root device is CUDA; on CPUs it silently trains with DDP's
default allreduce. ``GiftCommCallback()`` with no arguments completes that route: at
``on_fit_start`` (after the strategy has wrapped the model in DistributedDataParallel) it takes
the strategy's ``GiftState`` and registers it where Lightning did not. Given a state or options,
it registers its own. A hook already registered with the same state (Lightning on CUDA) is left
alone; a different hook already on the model is an error, as DDP takes one.

The callback subclasses ``lightning.pytorch.Callback`` when the ``lightning`` package is
installed, else ``pytorch_lightning.Callback``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch.nn.parallel import DistributedDataParallel

from ..geometry.schedule import GiftSchedule
from .torch.ddp import GiftState

if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the standalone package (its Callback: another class of the same shape)
        from pytorch_lightning import Callback

__all__ = ["GiftCommCallback"]

logger = logging.getLogger("giftcomm.adapters")


class GiftCommCallback(Callback):
    """Register ``gift_hook`` on the trainer's DDP model at the start of ``fit``.

    state: the :class:`~giftcomm.adapters.torch.GiftState` to use; or ``gift_options``, the
    keywords of ``GiftState(...)`` (fmt, block, rounding, seed, algorithm, slice_elems, timeout,
    schedule, ...: validated here, when the callback is built); or neither: the
    state given to ``DDPStrategy(ddp_comm_state=...)``, else ``GiftState()`` (e4m3). For
    ``schedule=GiftSchedule(geometry="kfac")`` or ``"paper"`` (the GIFT paper's preset, settings
    in the schedule's ``paper``) the word is enough: without ``capture=`` the state is built when fit starts, capturing the
    LightningModule (the other options are checked when the callback is built, as always); or
    pass ``capture=`` yourself. ``callback.state`` is the state in use
    (its ``stats()`` after training). With one process (no DDP wrapper, world size 1) nothing is
    registered. Raises TypeError when several processes train without a DDP strategy, and
    RuntimeError when the DDP model already has another communication hook.
    """

    def __init__(self, state: GiftState | None = None, **gift_options: Any) -> None:
        super().__init__()
        if state is not None and gift_options:
            raise TypeError("GiftCommCallback: pass a GiftState or GiftState's options, not both")
        if state is not None and not isinstance(state, GiftState):
            raise TypeError(f"GiftCommCallback: state must be a GiftState, got {type(state).__name__}")
        self._deferred: dict[str, Any] | None = None  # GiftState's options, built with capture=pl_module at fit
        schedule = gift_options.get("schedule")
        geometry = schedule.geometry if isinstance(schedule, GiftSchedule) else gift_options.get("geometry")
        if state is None and geometry in ("kfac", "paper") and gift_options.get("capture") is None:
            import torch

            GiftState(**{**gift_options, "capture": torch.nn.Module()}).shutdown()  # checks every other option now
            self._deferred = dict(gift_options)
            gift_options = {}
        self.state: GiftState | None = state if state is not None else (GiftState(**gift_options) if gift_options else None)
        self.registered = False

    def stats(self) -> Any:
        """What the hook sent (``callback.state.stats()``, a GiftStats that reads as the stats
        dict of every adapter: ``["calls"]``, ``["bytes_sent"]``, ``["algorithms"]``,
        ``["fallbacks"]``; docs/api.md, "What was sent"); zero counts before a state exists."""
        if self.state is None:
            return {"calls": 0, "bytes_sent": {}, "algorithms": {}, "fallbacks": {}}
        return self.state.stats()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        strategy = trainer.strategy
        ddp = strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            if trainer.world_size > 1:
                raise TypeError(f"GiftCommCallback needs a DDP strategy (strategy='ddp' or DDPStrategy(...)) to reduce "
                                f"gradients with giftcomm; the trainer's strategy is {type(strategy).__name__}")
            logger.info("giftcomm: one process and no DDP wrapper: GiftCommCallback registers nothing")
            return
        strategy_state = getattr(strategy, "_ddp_comm_state", None)
        if self.state is None and self._deferred is not None:  # the one word: capture the module being fit
            self.state = GiftState(**self._deferred, capture=pl_module)
        if self.state is None:
            if isinstance(strategy_state, GiftState):
                self.state = strategy_state
            elif strategy_state is not None or getattr(strategy, "_ddp_comm_hook", None) is not None:
                raise RuntimeError("GiftCommCallback: the DDP strategy has another communication hook "
                                   f"({getattr(strategy, '_ddp_comm_hook', None)!r}); give the strategy "
                                   "ddp_comm_state=GiftState(...), ddp_comm_hook=gift_hook, or drop its hook")
            else:
                self.state = GiftState()
        hooks = list(getattr(ddp, "_comm_hooks", []))
        if any(state is self.state for _, state in hooks):
            self.registered = True  # Lightning registered it (CUDA root device)
            return
        if hooks:
            raise RuntimeError(f"GiftCommCallback: the DDP model already has a communication hook ({hooks[0][0]!r}); "
                               "DDP takes one")
        self.state.register(ddp)
        self.registered = True
        logger.info("giftcomm: gift_hook registered on the DDP model (%s)", self.state.fmt)
