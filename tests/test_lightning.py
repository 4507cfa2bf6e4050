"""GiftCommCallback in a real Lightning Trainer, in one spawned process (a DDP world of 1, gloo):
the hook is registered and quantizes each bucket as giftcomm.allreduce does at P = 1; the callback refuses a strategy that carries
another comm hook and checks GiftState's options when it is built. The 2-process runs (strategy
route, callback under torchrun) are in tests/test_examples.py."""
from __future__ import annotations

import os
import pickle
import socket

from conftest import spawn_ranks

from giftcomm import GiftSchedule


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process_trainer(port: int, out: str) -> None:
    import datetime

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from giftcomm.adapters.lightning import GiftCommCallback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 3)

        def training_step(self, batch, batch_idx):
            self.last = batch[0]
            return self.net(batch[0]).pow(2).mean()

        def on_after_backward(self):  # one rank: DDP's gradients are the local ones through mxfp4, bit for bit
            import numpy as np

            from giftcomm.reference import simulate_allreduce

            x = self.last
            local = torch.nn.Linear(8, 3)
            local.load_state_dict(self.net.state_dict())
            local(x).pow(2).mean().backward()
            grads = [p.grad.numpy().ravel() for p in local.parameters()]  # 27 values: one mxfp4 block,
            want = simulate_allreduce([np.concatenate(grads)], "mxfp4", None, "avg")[0]  # so order does not matter
            got = np.concatenate([p.grad.numpy().ravel() for p in self.net.parameters()])
            same.append(bool(np.array_equal(got, want)) and not np.array_equal(got, np.concatenate(grads)))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.randn(12, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)
    same: list[bool] = []

    def trainer(strategy, callback):
        return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=[callback], max_steps=3,
                          logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    timeout = datetime.timedelta(seconds=60)
    res: dict = {}
    cb = GiftCommCallback(fmt="mxfp4")
    trainer(DDPStrategy(timeout=timeout), cb).fit(Tiny(), loader)
    res["registered"], res["stats"], res["same"] = cb.registered, cb.state.stats().as_dict(), list(same)
    res["callback_stats"] = dict(cb.stats())
    cb.state.shutdown()
    try:
        trainer(DDPStrategy(ddp_comm_hook=allreduce_hook, timeout=timeout), GiftCommCallback()).fit(Tiny(), loader)
        res["other_hook"] = None
    except RuntimeError as exc:
        res["other_hook"] = str(exc)
    # the paper's preset in one word: the LightningModule is captured when fit starts
    cb = GiftCommCallback(fmt="e4m3", schedule=GiftSchedule(geometry="paper", paper={"refresh_every": 1, "rank": 4}))
    module = Tiny()
    trainer(DDPStrategy(timeout=timeout), cb).fit(module, loader)
    cap = cb.state.capture
    res["paper"] = (cb.registered, cb.state.schedule.geometry, cb.state.schedule.paper.rank, sorted(cap.layers.values()),
                    cap.estimator.counts.get("net.weight", 0))
    cb.state.shutdown()
    try:
        GiftCommCallback(schedule=GiftSchedule(geometry="paper", paper={"ranks": 4}))
        res["bad_paper"] = None
    except TypeError as exc:
        res["bad_paper"] = str(exc)
    try:
        GiftCommCallback(fmt="nvfp4", block=256)
        res["bad_option"] = None
    except ValueError as exc:
        res["bad_option"] = str(exc)
    with open(out, "wb") as f:
        pickle.dump(res, f)


def test_callback_in_a_one_process_ddp_trainer(tmp_path):
    port = _free_port()
    (res,) = spawn_ranks(1, str(tmp_path), lambda r, out: (_one_process_trainer, (port, out)))
    s = res["stats"]
    assert res["registered"] and s["host_buckets"] == 3, s
    assert res["callback_stats"]["calls"] == 3, res["callback_stats"]  # one process quantizes too
    assert res["same"] == [True] * 3, res["same"]
    assert res["other_hook"] is not None and "another communication hook" in res["other_hook"]
    assert res["bad_option"] is not None and res["bad_option"].startswith("GiftState: ")
    registered, geometry, rank, layers, fed = res["paper"]
    assert registered and geometry == "paper" and rank == 4 and layers == ["net.weight"] and fed > 0, res["paper"]
    assert res["bad_paper"] is not None and "ranks" in res["bad_paper"]

