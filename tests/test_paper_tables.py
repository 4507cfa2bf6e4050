"""studies.paper_tables (the GIFT paper's Tables I and II) on a tiny capture made here, checked
against a plain restatement of the definitions (explicit inverses, ml_dtypes casts)."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from studies import paper_tables as pt  # noqa: E402


@pytest.fixture(autouse=True)
def _one_blas_thread():
    with pt.single_threaded_blas():
        yield


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    from studies.gradients import capture as cap

    path = str(tmp_path_factory.mktemp("paper") / "tiny.npz")
    cap("tiny", train_steps=4, capture_steps=2, ranks=2, batch=4, kfac_rows=64, out=path, log=None)
    return path


def _e5m2_tensor(x):
    """The paper's wire restated: one scale per tensor, amax -> 57344, RNE to E5M2."""
    s = np.float32(np.abs(x).max() / 57344.0)
    return (np.clip(x.astype(np.float32) / s, -57344, 57344).astype(ml_dtypes.float8_e5m2).astype(np.float64)
            * np.float64(s))


def test_cli_json_shape_and_definitions(capture, tmp_path):
    out = tmp_path / "t.json"
    assert pt.main([capture, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["table1"]) == set(pt.WIRES) and set(res["table2"]) == set(pt.WIRES)
    for wire in pt.WIRES:
        assert set(res["table1"][wire]) == set(pt.TABLE1_ROWS)
        assert set(res["table2"][wire]) == set(pt.TABLE2_ROWS)
        for d in (*res["table1"][wire].values(), *res["table2"][wire].values()):
            assert 0 < d["rel_l2"] < 0.5 and 0.9 < d["cos"] <= 1.0
        # Table II's "full A" is Table I's input side
        assert res["table2"][wire]["full"] == res["table1"][wire]["input"]
    # coarser wires lose more: NVFP4 above the FP8 ones, in every row
    for row in pt.TABLE1_ROWS:
        assert res["table1"]["nvfp4"][row]["rel_l2"] > res["table1"]["e4m3/256"][row]["rel_l2"]
    assert set(res["per_kind"]["table1"]["e5m2/tensor"]) == {"attn.q", "attn.k", "attn.v", "attn.o",
                                                              "mlp.up", "mlp.gate", "mlp.down"}

    # independent restatement: mean over the last step's ranks, explicit inverses of the factors
    z = np.load(capture)
    names, shapes = [str(x) for x in z["names"]], json.loads(str(z["shapes"]))
    flat, off = z["grads"][-1].astype(np.float64).mean(0), 0
    err = {"euclidean": 0.0, "input": 0.0, "output": 0.0, "full": 0.0}
    gg = 0.0
    for nm, sh in zip(names, shapes):
        size = int(np.prod(sh))
        w = flat[off:off + size].reshape(sh)
        off += size
        if f"A/{nm}" not in z.files:
            continue
        a, g = (z[f"{p}/{nm}"].astype(np.float64) for p in ("A", "G"))
        la = np.linalg.cholesky(a + 1e-3 * np.eye(a.shape[0]))
        lg = np.linalg.cholesky(g + 1e-3 * np.eye(g.shape[0]))
        ia, ig = np.linalg.inv(la), np.linalg.inv(lg)
        err["euclidean"] += np.sum((_e5m2_tensor(w) - w) ** 2)
        err["input"] += np.sum((_e5m2_tensor(w @ ia.T) @ la.T - w) ** 2)
        err["output"] += np.sum((lg @ _e5m2_tensor(ig @ w) - w) ** 2)
        err["full"] += np.sum((lg @ _e5m2_tensor(ig @ w @ ia.T) @ la.T - w) ** 2)
        gg += np.sum(w * w)
    for row, e in err.items():
        assert res["table1"]["e5m2/tensor"][row]["rel_l2"] == pytest.approx(np.sqrt(e / gg), rel=2e-3), row


def test_approximations_restated():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((400, 96)) * np.geomspace(10, 0.1, 96)
    a = x.T @ x / 400
    assert np.array_equal(pt.approximate(a, "diag"), np.diag(np.diag(a)))
    b = pt.approximate(a, "block-32")
    assert np.array_equal(b[:32, :32], a[:32, :32]) and not b[:32, 32:].any() and np.array_equal(b[64:, 64:],
                                                                                                  a[64:, 64:])
    assert np.array_equal(pt.approximate(a, "block-128"), a)  # one (partial) block holds all of it
    lam, u = np.linalg.eigh(a)
    low = (u[:, -8:] * lam[-8:]) @ u[:, -8:].T
    approx = pt.approximate(a, "lowrank-8")
    np.testing.assert_allclose(approx - np.diag(np.diag(approx)), low - np.diag(np.diag(low)), atol=1e-10)
    np.testing.assert_allclose(np.diag(approx), np.diag(low) + np.maximum(np.diag(a - low), 1e-3), rtol=1e-10)
    # full rank: A itself, its residual diagonal (zero) raised to the floor d
    np.testing.assert_allclose(pt.approximate(a, "lowrank-96"), a + 1e-3 * np.eye(96), atol=1e-9)
    la = pt.chol(a)
    np.testing.assert_allclose(la @ la.T, a + 1e-3 * np.eye(96), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="positive definite"):
        pt.chol(-np.eye(4))
    with pytest.raises(ValueError, match="unknown approximation"):
        pt.approximate(a, "sparse-3")


def test_pooling_and_shards(capture):
    grads, facs, info = pt.load(capture, shards=0)
    g1, _, i1 = pt.load(capture, shards=1)
    assert i1["tokens_per_gradient"] * 2 == info["tokens_per_gradient"]
    assert any(not np.array_equal(grads[k], g1[k]) for k in grads)
    with pytest.raises(ValueError, match="shards"):
        pt.load(capture, shards=5)
    # pooling: sqrt(sum err^2 / sum g^2) over the layers, not the mean of the layers' RelL2
    res = pt.tables(grads, facs, wires=("mxfp8",))
    per = [res["per_layer"][k]["table1"]["mxfp8"]["euclidean"]["rel_l2"] for k in grads]
    norms = [np.sum(grads[k] ** 2) for k in grads]
    pooled = np.sqrt(sum(r * r * n for r, n in zip(per, norms)) / sum(norms))
    assert res["table1"]["mxfp8"]["euclidean"]["rel_l2"] == pytest.approx(pooled, rel=1e-9)
    assert pt.kind("blocks.3.mlp.down.weight") == "mlp.down"
    assert pt.kind("bert.encoder.layer.5.attention.self.query.weight") == "attention.self.query"


def test_symmetric_factor_restated(capture):
    """``--factor symmetric``: the input row is W S^-1 quantized and mapped back by S, with
    S = (A + d I)^1/2 (an eigendecomposition here), for the paper's wire; and it differs from
    the Cholesky row (a different map, the same error scale)."""
    grads, facs, _ = pt.load(capture)
    res = pt.tables(grads, facs, wires=("e5m2/tensor",), factor="symmetric")
    chol = pt.tables(grads, facs, wires=("e5m2/tensor",))
    e = gg = 0.0
    for nm, w in grads.items():
        a = facs[nm][0]
        lam, u = np.linalg.eigh(0.5 * (a + a.T) + 1e-3 * np.eye(a.shape[0]))
        root, inv_root = (u * lam**0.5) @ u.T, (u * lam**-0.5) @ u.T
        e += np.sum((_e5m2_tensor(w @ inv_root) @ root - w) ** 2)
        gg += np.sum(w * w)
    got = res["table1"]["e5m2/tensor"]["input"]["rel_l2"]
    assert got == pytest.approx(np.sqrt(e / gg), rel=2e-3)
    assert res["table1"]["e5m2/tensor"]["euclidean"] == chol["table1"]["e5m2/tensor"]["euclidean"]
    assert got != chol["table1"]["e5m2/tensor"]["input"]["rel_l2"]
    s = pt.chol(facs[next(iter(facs))][0], factor="symmetric")
    np.testing.assert_allclose(s, s.T, atol=0)
    with pytest.raises(ValueError, match="factor must be one of"):
        pt.chol(np.eye(3), factor="qr")


def test_muon_capture_kind_filter_and_selection_scores(tmp_path):
    """studies.gradients --optimizer muon trains with Muon on the blocks' 2-D weights (the
    capture says so, and its weights differ from AdamW's from the same seed); paper_gain --kind
    keeps that kind's layers only; paper_scores is saturation_fraction restated per shard."""
    from giftcomm.geometry.paper import PaperOptions, select_for
    from studies import paper_gain, paper_scores
    from studies.gradients import _Optimizers
    from studies.gradients import capture as cap
    from studies.workloads.llama import CONFIGS, Llama

    model = Llama(CONFIGS["tiny"])
    opts = _Optimizers(model, "muon", 1e-3).opts
    assert [type(o).__name__ for o in opts] == ["AdamW", "Muon"]
    hidden = {id(p) for g in opts[1].param_groups for p in g["params"]}
    assert hidden == {id(p) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
    with pytest.raises(ValueError, match="unknown optimizer"):
        _Optimizers(model, "sgd", 1e-3)
    paths = {}
    for opt in ("adamw", "muon"):
        paths[opt] = str(tmp_path / f"{opt}.npz")
        cap("tiny", train_steps=3, capture_steps=1, ranks=2, batch=4, kfac_rows=32, out=paths[opt], log=None,
            optimizer=opt)
    info = json.loads(str(np.load(paths["muon"])["info"]))
    assert info["optimizer"] == "muon"
    assert not np.array_equal(np.load(paths["muon"])["grads"], np.load(paths["adamw"])["grads"])
    res = paper_gain.study(paths["muon"], ("e5m2/tensor",), log=None, layer_kind="mlp.down")
    assert res["layers"] and all(n.endswith("mlp.down.weight") for n in res["layers"])
    assert "muon" in res["label"]
    with pytest.raises(ValueError, match="no layer of kind"):
        paper_gain.study(paths["muon"], ("e5m2/tensor",), log=None, layer_kind="nope")
    sc = paper_scores.scores(paths["muon"])
    grads, _, _ = pt.load(paths["muon"], "ema", 0)
    assert set(sc) == set(grads)
    z = np.load(paths["muon"])
    names, shapes = [str(x) for x in z["names"]], json.loads(str(z["shapes"]))
    off = 0
    for n, sh in zip(names, shapes):
        size = int(np.prod(sh))
        if n in sc:  # the mean over the (steps x ranks) shards of the share of codes at a bound
            fr = []
            for shard in z["grads"].reshape(-1, z["grads"].shape[-1])[:, off:off + size]:
                s = np.float32(np.abs(shard).max() / 57344.0)
                q = np.abs(np.clip(shard / s, -57344, 57344).astype(ml_dtypes.float8_e5m2).astype(np.float32))
                fr.append(np.mean((q >= 57344) | ((shard != 0) & (q <= 2.0**-16))))
            assert sc[n] == (pytest.approx(float(np.mean(fr)), abs=1e-12), size)
            assert sc[n][0] >= 1.0 / size  # the largest value alone hits the upper bound
        off += size
    assert select_for(PaperOptions(), {n: v for n, (v, _) in sc.items()})
