"""The paper preset and the paper's wire on the FSDP2 comm (GiftReduceScatter), run for real:
spawned ranks over gloo (P = 2), the model of tests/test_fsdp.py.

- ranks that disagree on when or how to refresh (refresh_every, a call count off by one) raise
  the same ValueError on every rank at the first call, well inside the deadline;
- ``register_reduce_scatter(...).state_dict()`` saved at any step (a refresh step or between two)
  and loaded into freshly registered comms continues bit-identical to the uninterrupted run;
- ``baseline="e5m2/tensor-nccl"`` (with and without the paper's map): every shard equals the
  reference simulation of the wire (giftcomm.reference.simulate_baseline_allreduce) bit for bit.
"""
from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import torch
from test_fsdp import _batch, _model, _Recorder
from test_torchrun import _spawn

from giftcomm import GiftSchedule
from giftcomm.reference.baselines import simulate_baseline_allreduce

pytestmark = pytest.mark.xdist_group("fsdp")

PAPER = {"refresh_every": 2, "rank": 4}
WIRE = "e5m2/tensor-nccl"


def _fsdp_model():
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _register(model, paper=PAPER, **kw):
    from giftcomm.adapters.torch import register_reduce_scatter

    knobs = {k: kw.pop(k) for k in ("error_feedback",) if k in kw}
    return register_reduce_scatter(model, fmt="e4m3", allow_native=False,
                                   schedule=GiftSchedule(geometry="paper", paper=paper, **knobs), capture=model,
                                   capture_every=1, capture_tokens=4, **kw)


def _steps(model, comms, rank, start, stop, save_at=None):
    """Steps ``start .. stop-1`` (SGD); each step's local gradient shards as bytes, and at
    ``save_at`` the pickled (local parameter shards, comms' state)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out, saved = [], None
    for step in range(start, stop):
        if step == save_at:
            params = [p.to_local().detach().clone() for p in model.parameters()]
            saved = pickle.dumps((params, comms.state_dict()))
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        out.append(b"".join(p.grad.to_local().detach().numpy().tobytes() for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    return out, saved


def _first_error(model, rank, steps=2):
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            x, y = _batch(rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
        return None
    except Exception as exc:  # what FSDP's backward raised from the comm
        return type(exc).__name__, str(exc), time.perf_counter() - t0


def _worker(rank, world):
    import os
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ["GIFTCOMM_TIMEOUT"] = "60"
    res: dict = {}
    # --- resume at any step, bit-identical (refresh_every 2: step 3 between refreshes, 4 a refresh step)
    model = _fsdp_model()
    res["whole"] = _steps(model, _register(model, error_feedback=True), rank, 0, 7, save_at=None)[0]
    for save_at in (3, 4):
        model = _fsdp_model()
        _, saved = _steps(model, _register(model, error_feedback=True), rank, 0, save_at + 1, save_at=save_at)
        params, state = pickle.loads(saved)
        fresh = _fsdp_model()
        comms = _register(fresh, error_feedback=True)
        with torch.no_grad():
            for p, v in zip(fresh.parameters(), params):
                p.to_local().copy_(v)
        comms.load_state_dict(state)
        res[f"resumed{save_at}"] = _steps(fresh, comms, rank, save_at, 7)[0]
        lost = _fsdp_model()  # the same parameters and counts, without the paper's state
        comms = _register(lost, error_feedback=True)
        with torch.no_grad():
            for p, v in zip(lost.parameters(), params):
                p.to_local().copy_(v)
        for c, s in zip(comms, state["comms"]):
            c.calls = s["calls"] - s["calls"] % 2  # the refresh at or before: from this step's A alone
        res[f"lost{save_at}"] = _steps(lost, comms, rank, save_at, 7)[0]
    # --- ranks that disagree: the same error on every rank, at once
    model = _fsdp_model()
    _register(model, dict(PAPER, refresh_every=2 + rank))
    res["refresh_every"] = _first_error(model, rank)
    model = _fsdp_model()
    comms = _register(model)
    comms[0].calls += rank == 0  # rank 0 one call ahead on the first module (a skipped step)
    res["calls"] = _first_error(model, rank)
    # --- the paper's wire: plain, and under the paper's map (refresh_every large: one map)
    paper_schedule = GiftSchedule(geometry="paper", paper={"refresh_every": 100, "rank": 4})
    for name, kw in (("wire", {}), ("wire-paper", {"schedule": paper_schedule, "capture": "model", "capture_every": 1})):
        from giftcomm.adapters.torch import register_reduce_scatter
        from giftcomm.adapters.torch.fsdp import fsdp_modules

        model = _fsdp_model()
        if kw.get("capture") == "model":
            kw = dict(kw, capture=model)
        comms = register_reduce_scatter(model, baseline=WIRE, **kw)
        recs = []
        for m, c in zip(fsdp_modules(model), comms):
            rec = _Recorder(c)
            m.set_custom_reduce_scatter(rec)
            recs.append(rec)
        _steps(model, comms, rank, 0, 2)
        res[name] = {"calls": [r.calls for r in recs], "geometries": [c.geometry for c in comms]}
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _spawn(_worker, 2, tmp_path_factory.mktemp("paper_fsdp"))


def test_state_dict_resumes_bit_identical_at_any_step(results):
    for r in results:
        for save_at in (3, 4):
            assert r[f"resumed{save_at}"] == r["whole"][save_at:], save_at
            assert r[f"lost{save_at}"] != r["whole"][save_at:], save_at  # the state mattered


@pytest.mark.parametrize("case,fragment", [("refresh_every", "refresh_every (rank 0: 2, rank 1: 3)"),
                                           ("calls", "sync (rank 0: 1, rank 1: 0)")])
def test_ranks_that_disagree_raise_the_same_error_at_once(results, case, fragment):
    got = [r[case] for r in results]
    assert all(g is not None for g in got), got
    assert len({g[1] for g in got}) == 1, got  # one and the same message on every rank
    assert all(g[0] in ("ValueError", "RuntimeError") for g in got)  # FSDP's backward may wrap it
    assert "the ranks disagree on when or how to refresh" in got[0][1] and fragment in got[0][1]
    assert all(g[2] < 30 for g in got), got  # at once, not at the deadline (60 s)


def _wire_shard(xs, rank, op, geo=None):
    """Rank ``rank``'s shard of the wire's allreduce of every rank's input ``xs`` (float32 (N,)),
    rows mapped by ``geo`` (a ShardedGeometry) first and back after, op applied last."""
    p = len(xs)
    if geo is not None:
        xs = [np.asarray(geo.forward_rows(x.reshape(p, -1)), np.float32).reshape(-1) for x in xs]
    n = xs[0].size // p
    shard = simulate_baseline_allreduce(xs, WIRE, op="sum")[rank][rank * n : (rank + 1) * n]
    if geo is not None:
        shard = np.asarray(geo.shard(rank).inverse(shard), np.float32)
    if "AVG" in op:
        shard = shard / np.float32(p)
    if "PREMUL_SUM" in op:
        raise AssertionError("no gradient divide factor was set")
    return shard


@pytest.mark.parametrize("case", ["wire", "wire-paper"])
def test_baseline_wire_is_the_simulation_bit_for_bit(results, case):
    p = len(results)
    calls = [r[case]["calls"] for r in results]
    checked = 0
    for k in range(len(calls[0])):
        geo = results[0][case]["geometries"][k]
        for j in range(len(calls[0][k])):
            xs = [calls[r][k][j][0] for r in range(p)]
            for r in range(p):
                want = _wire_shard(xs, r, calls[r][k][j][2], geo)
                assert calls[r][k][j][1].tobytes() == want.tobytes(), (case, k, j, r)
                checked += 1
    assert checked > 0
    if case == "wire-paper":
        assert any(g is not None for g in results[0][case]["geometries"])
