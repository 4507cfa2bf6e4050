"""Error feedback through the torch.distributed entry points, run for real: the DDP hook's
GiftState and FSDP2's GiftReduceScatter, torchrun-style spawned ranks over gloo at P = 2.

The problem is one where feedback provably helps: a fixed gradient per rank (no optimizer step),
reduced step after step with 4-bit rounding to nearest. Without feedback every step has the same
error and the mean of the steps keeps it; with it the running sum of the results telescopes to
the running sum of the gradients, so the mean's error shrinks like 1/steps. A pickled GiftState
carries this rank's residuals, and training resumed from it matches the uninterrupted run.
"""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from test_torchrun import _spawn

from giftcomm import GiftSchedule

STEPS = 16


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 20))


def _data(rank):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(8, 24, generator=g), torch.randn(8, 20, generator=g) ** 3


def _flat_grads(model, local=False):
    return np.concatenate([(p.grad.to_local() if local else p.grad).detach().float().numpy().ravel()
                           for p in model.parameters()])


def _own_grads(rank):
    model = _model()
    x, w = _data(rank)
    (model(x) * w).sum().backward()
    return _flat_grads(model)


def _ddp(rank, steps, ef, state=None):
    from torch.nn.parallel import DistributedDataParallel

    from giftcomm.adapters.torch import GiftState, gift_hook

    model = _model()
    ddp = DistributedDataParallel(model)
    if state is None:
        state = GiftState(fmt="nvfp4", algorithm="oneshot", schedule=GiftSchedule(error_feedback=ef))
    state.bind(model)  # named parameters: a residual follows them through DDP's bucket rebuild
    ddp.register_comm_hook(state, gift_hook)
    x, w = _data(rank)
    outs = []
    for _ in range(steps):
        ddp.zero_grad()
        (ddp(x) * w).sum().backward()
        outs.append(_flat_grads(model))
    blob = pickle.dumps(state)
    state.shutdown()
    return outs, blob


def _fsdp(rank, ef):
    from torch.distributed.fsdp import fully_shard

    from giftcomm.adapters.torch import register_reduce_scatter

    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    comms = register_reduce_scatter(model, fmt="nvfp4", algorithm="direct", schedule=GiftSchedule(error_feedback=ef))
    x, w = _data(rank)
    outs = []
    for _ in range(STEPS):
        model.zero_grad()
        (model(x) * w).sum().backward()
        outs.append(_flat_grads(model, local=True))
    return outs, [c.algorithm_used for c in comms], [c.state_dict() for c in comms]


def _worker(rank, world):
    res: dict = {"own": _own_grads(rank)}
    for ef in (False, True):
        res[f"ddp{ef}"] = _ddp(rank, STEPS, ef)[0]
        res[f"fsdp{ef}"] = _fsdp(rank, ef)
    first, blob = _ddp(rank, 6, True)
    restored = pickle.loads(blob)
    res["residuals"] = restored.feedback.state_dict()["residuals"]
    resumed, blob = _ddp(rank, 6, True, state=restored)
    res["first"], res["resumed"] = first, resumed
    res["final"] = pickle.loads(blob).feedback.state_dict()  # residuals and their layout after 12 steps
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _spawn(_worker, 2, tmp_path_factory.mktemp("feedback"))


def _mean_error(steps, exact):
    return np.linalg.norm(np.mean(np.array(steps, np.float64), axis=0) - exact) / np.linalg.norm(exact)


def test_ddp_hook_feedback_converges_to_the_true_mean(results):
    exact = np.mean([r["own"].astype(np.float64) for r in results], axis=0)
    without, with_fb = _mean_error(results[0]["ddpFalse"], exact), _mean_error(results[0]["ddpTrue"], exact)
    assert without > 0.02
    assert with_fb < without / 8
    assert results[0]["ddpTrue"][-1].tobytes() == results[1]["ddpTrue"][-1].tobytes()


def test_gift_state_pickles_this_ranks_residuals_and_resumes(results):
    """6 steps, pickle each rank's state, a new DDP with the unpickled state, 6 more: the results
    still telescope across the checkpoint, ``sum(out_t) = 12 * exact - mean_r(residual_r)``,
    which holds only if every rank's residual was carried over (a new DDP starts with its
    initial bucket order, and the residual follows its named parameters into it and back)."""
    from giftcomm.collectives.feedback import reordered

    res = [r["residuals"] for r in results]
    assert res[0] and set(res[0]) == set(res[1])
    assert any(not np.array_equal(res[0][k], res[1][k]) for k in res[0])  # each rank's own
    exact = np.mean([r["own"].astype(np.float64) for r in results], axis=0)
    model = _model()
    param_order = tuple((f"torch.float32:{n}", p.numel()) for n, p in model.named_parameters())
    last = np.mean([reordered(r["final"]["residuals"][0], r["final"]["signatures"][0], param_order)
                    for r in results], axis=0)
    for r in results:
        total = np.sum(np.array(r["first"] + r["resumed"], np.float64), axis=0)
        drift = np.linalg.norm(total - (12 * exact - last)) / np.linalg.norm(12 * exact)
        assert drift < 1e-5
        # without the carried residual the identity would be off by a whole step's error
        lost = np.linalg.norm(np.mean([x["residuals"][0] for x in results], axis=0))
        assert lost / np.linalg.norm(12 * exact) > 100 * drift


def test_fsdp_comm_feedback_converges_to_the_true_mean(results):
    exact = np.mean([r["own"].astype(np.float64) for r in results], axis=0)
    # the ranks' local shards, in rank order, are the flat sharded gradient of each parameter
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    rows = [p.shape[0] for p in model.parameters()]

    def assemble(ef):
        steps = []
        for s in range(STEPS):
            parts, off = [], [0, 0]
            for n, rws in zip(sizes, rows):
                per = [-(-rws // 2), rws - (-(-rws // 2))]  # FSDP2's Shard(0): ceil-sized first rows
                cols = n // rws
                for r in range(2):
                    parts.append(results[r][f"fsdp{ef}"][0][s][off[r] : off[r] + per[r] * cols])
                    off[r] += per[r] * cols
            steps.append(np.concatenate(parts))
        return steps

    without, with_fb = _mean_error(assemble(False), exact), _mean_error(assemble(True), exact)
    assert without > 0.02
    assert with_fb < without / 8
    for r in results:
        assert r["fsdpTrue"][1] and set(r["fsdpTrue"][1]) == {"direct"}
        assert all(d["error_feedback"]["residuals"] for d in r["fsdpTrue"][2])
