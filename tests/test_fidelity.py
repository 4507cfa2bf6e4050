"""The fidelity study (studies.fidelity): metrics on constructed cases, the synthetic mode
at small size, the budget-aware selective policy, and MPI == simulator (pytest -m mpi)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from giftcomm.geometry import Layout, SelectivePolicy, TransformTimeModel, collective_seconds, select
from studies import fidelity as fid


def _seed(rng) -> int:
    return int(rng.integers(2**31))


# ------------------------------------------------------------------ metrics on constructed cases
def test_sign_flips_and_zeroed_entries_are_counted_right(rng):
    n = 1000
    exact = rng.standard_normal(n)
    exact[rng.choice(n, 100, replace=False)] = 0.0  # exact zeros are not counted
    approx = exact.copy()
    nz = np.flatnonzero(exact)
    flip = rng.choice(nz, 37, replace=False)
    rest = np.setdiff1d(nz, flip)
    zero = rng.choice(rest, 11, replace=False)
    approx[flip] *= -rng.uniform(0.5, 2.0, flip.size)
    approx[zero] = 0.0
    approx[exact == 0] = rng.standard_normal(100)  # noise where exact is 0: neither flipped nor zeroed
    assert fid.sign_flip_fraction(approx, exact) == pytest.approx(37 / 900)
    assert fid.zeroed_fraction(approx, exact) == pytest.approx(11 / 900)
    assert fid.sign_flip_fraction(exact, exact) == 0.0 == fid.zeroed_fraction(exact, exact)


def test_relative_l2_and_cosine(rng):
    s = rng.standard_normal(500)
    e = rng.standard_normal(500)
    assert fid.relative_l2(s + e, s) == pytest.approx(np.linalg.norm(e) / np.linalg.norm(s))
    assert fid.relative_l2(s.astype(np.float32), s.astype(np.float32)) == 0.0
    assert fid.cosine(s, 3.0 * s) == pytest.approx(1.0)
    assert fid.cosine(s, -s) == pytest.approx(-1.0)
    q = rng.standard_normal(500)
    q -= q @ s / (s @ s) * s
    assert abs(fid.cosine(s, q)) < 1e-12


def test_adam_update_from_fresh_moments(rng):
    g = rng.standard_normal(200) * np.logspace(-4, 1, 200)
    # one step, bias-corrected: m_hat = g, v_hat = g^2, so the update is g / (|g| + eps)
    np.testing.assert_allclose(fid.adam_update([g]), g / (np.abs(g) + 1e-8), rtol=1e-12)
    # invariant to a common scale of the gradients (up to eps)
    gs = [rng.standard_normal(50) for _ in range(4)]
    np.testing.assert_allclose(fid.adam_update(gs), fid.adam_update([7.0 * x for x in gs]), rtol=1e-6)


def test_whitened_norm_is_plain_norm_for_identity_factors(rng):
    layout = Layout([("w", (12, 20)), ("b", (12,)), ("v", (20, 8))])
    metric = fid.WhiteningMetric(layout, {"w": (np.eye(20) * 3.0, np.eye(12) * 0.2), "v": (np.eye(8), np.eye(20))})
    s = rng.standard_normal(layout.size)
    a = s + 0.01 * rng.standard_normal(layout.size)
    ratios = metric.ratios(a, s)
    assert set(ratios) == {"w", "v"}
    for name, r in ratios.items():
        seg = layout[name]
        assert r == pytest.approx(fid.relative_l2(a[seg.offset:seg.stop], s[seg.offset:seg.stop]), rel=1e-12)
    w = np.array([240.0, 160.0])
    r = np.array([ratios["w"], ratios["v"]])
    assert metric.aggregate(ratios) == pytest.approx(np.sqrt((w * r * r).sum() / w.sum()))


def test_whitened_norm_undoes_the_kronecker_structure(rng):
    m, n = 16, 24
    a, g = fid.kron_factor(rng, n, 1e3, "exp"), fid.kron_factor(rng, m, 1e2, "power")
    metric = fid.WhiteningMetric([("w", (m, n))], {"w": (a, g)}, damping=0.0)
    z = rng.standard_normal((m, n))
    x = fid._sqrt_psd(g) @ z @ fid._sqrt_psd(a)
    # normalised factors: W(x) = z * sqrt(mean eig G * mean eig A)
    scale = np.sqrt(np.trace(g) / m * np.trace(a) / n)
    np.testing.assert_allclose(metric.whiten("w", x), z * scale, rtol=1e-7, atol=1e-9)


def test_kron_factor_spectra(rng):
    for spectrum in ("power", "exp"):
        f = fid.kron_factor(rng, 50, 1e4, spectrum)
        w = np.linalg.eigvalsh(f)
        assert w.max() / w.min() == pytest.approx(1e4, rel=1e-6)
        np.testing.assert_allclose(f, f.T, atol=1e-14)


# ------------------------------------------------------------------ the study at small size
def test_synthetic_study_gift_beats_euclidean_in_the_whitened_norm(rng):
    case = fid.synthetic_case([(48, 64), (64, 40)], cond=1e4, spectrum="power", ranks=3, steps=2, seed=_seed(rng))
    methods = [m for m in fid.default_methods(ranks=(8,)) if m.label in
               ("bf16", "e4m3 per-tensor", "e4m3 block256", "gift full", "gift k=8", "hadamard")]
    rows = {r["method"]: r for r in fid.evaluate(case, methods)}
    eu, full = rows["e4m3 block256"], rows["gift full"]
    assert eu["bytes_per_value"] == full["bytes_per_value"] == 1.015625
    assert rows["bf16"]["bytes_per_value"] == 2.0
    assert rows["e4m3 per-tensor"]["bytes_per_value"] < eu["bytes_per_value"]
    assert full["whitened"] < 0.25 * eu["whitened"]
    assert rows["gift k=8"]["whitened"] < eu["whitened"]
    # Plain L2: at most 1.5x Euclidean (the fidelity target's bound), on average. One small case (2 steps, 3 ranks) is too
    # noisy for a bound (its ratio ranged 0.6-1.8 over 60 seeds), so take the geometric mean of
    # this case and four more.
    ratios = [full["rel_l2"] / eu["rel_l2"]]
    l2_methods = [m for m in methods if m.label in ("e4m3 block256", "gift full")]
    for _ in range(4):
        more = fid.synthetic_case([(48, 64), (64, 40)], cond=1e4, spectrum="power", ranks=3, steps=2, seed=_seed(rng))
        r = {x["method"]: x for x in fid.evaluate(more, l2_methods)}
        ratios.append(r["gift full"]["rel_l2"] / r["e4m3 block256"]["rel_l2"])
    assert float(np.exp(np.mean(np.log(ratios)))) < 1.5, ratios
    # the fp64 sum is reproduced best by BF16; every FP8 method errs at the percent level
    assert rows["bf16"]["rel_l2"] < 0.2 * eu["rel_l2"] and 1e-3 < eu["rel_l2"] < 0.2
    for r in rows.values():
        assert 0.9 < r["adam_cos"] <= 1.0 + 1e-12
        assert 0.0 <= r["flipped"] < 0.1 and 0.0 <= r["zeroed"] < 0.1
        assert r["mpi_equals_sim"] is None
    assert rows["gift full"]["transformed"] == pytest.approx(48 * 64 / case.layout.size + 64 * 40 / case.layout.size)
    table = fid.format_table(list(rows.values()))
    assert table.count("\n") == len(rows) + 1 and "gift full" in table


def test_main_synthetic_writes_json_and_markdown(tmp_path, rng):
    out, md = tmp_path / "f.json", tmp_path / "f.md"
    rc = fid.main(["synthetic", "--conds", "1e3", "--spectra", "exp", "--shapes", "32x48", "--steps", "1",
                   "--ranks", "2", "--ks", "4", "--seed", str(_seed(rng)), "--json", str(out), "--out", str(md),
                   "--budget", "0.1", "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["results"][0]["rows"]
    assert [r["method"] for r in rows][:3] == ["bf16", "e4m3 per-tensor", "e4m3 block256"]
    assert any(r["method"] == "gift budget 0.1" for r in rows)
    assert "| gift full |" in md.read_text()


# ------------------------------------------------------------------ budget-aware policy
def _factors(rng, layout, cond=1e4):
    return {s.name: (fid.kron_factor(rng, s.matrix_shape[1], cond), fid.kron_factor(rng, s.matrix_shape[0], cond))
            for s in layout if s.ndim == 2}


def _predicted(geo, tm):
    return tm.geometry_seconds(geo)


def test_budgeted_policy_keeps_the_predicted_time_within_the_budget(rng):
    layout = Layout([("a", (96, 128)), ("a.bias", (96,)), ("b", (128, 64)), ("c", (64, 64)), ("d", (200, 96))])
    factors = _factors(rng, layout)
    tm = TransformTimeModel()
    wire = collective_seconds(layout.size, 4, 125e6)
    assert wire == pytest.approx(1.5 * layout.size * 1.015625 / 125e6)
    gains = []
    for frac in (0.0, 0.05, 0.2, 1.0, 5.0, 1e3):
        geo = select(layout, factors, SelectivePolicy.budgeted(frac))
        assert _predicted(geo, tm) <= frac * wire * (1 + 1e-9)
        assert geo["a.bias"].is_identity
        # predicted removed squared error, in the policy's own weights
        g = 0.0
        for t in geo.transforms:
            if not t.is_identity:
                ag, aa = t.info["anisotropy"]
                g += t.segment.size * ag * aa * (1 - t.info["predicted"] ** 2)
        gains.append(g)
        x = rng.standard_normal(layout.size).astype(np.float32)
        np.testing.assert_allclose(geo.inverse(geo.forward(x)), x, rtol=1e-3, atol=1e-3)
    assert gains[0] == 0.0
    assert all(b >= a - 1e-9 for a, b in zip(gains, gains[1:]))  # more budget never predicts less gain
    assert gains[-1] > 0
    # an unlimited budget transforms every eligible segment
    assert all(not select(layout, factors, SelectivePolicy.budgeted(1e6))[n].is_identity for n in "abcd")


def test_budgeted_policy_prefers_the_most_anisotropic_segment(rng):
    layout = Layout([("iso", (128, 128)), ("aniso", (128, 128))])
    factors = {"iso": (fid.kron_factor(rng, 128, 3.0), fid.kron_factor(rng, 128, 3.0)),
               "aniso": (fid.kron_factor(rng, 128, 1e5), fid.kron_factor(rng, 128, 1e5))}
    tm = TransformTimeModel()
    one = tm.seconds(128 * 128, 2.0 * (4.0 * 128 * 8 + 2 * 128 + 8) * 128, "lowrank", "identity")
    fixed = sum(tm.copy_seconds(s.size) for s in layout)  # the output copies of a non-identity geometry
    frac = (fixed + 1.5 * one) / collective_seconds(layout.size, 4, 125e6)  # room for about one cheap transform
    geo = select(layout, factors, SelectivePolicy.budgeted(frac))
    assert geo["iso"].is_identity and not geo["aniso"].is_identity


def test_budget_below_the_copy_cost_gives_the_identity(rng):
    layout = Layout([("w", (256, 192)), ("v", (192, 256))])
    factors = _factors(rng, layout, 1e5)
    tm = TransformTimeModel()
    fixed = sum(tm.copy_seconds(s.size) for s in layout)
    frac = 0.9 * fixed / collective_seconds(layout.size, 4, 125e6)
    geo = select(layout, factors, SelectivePolicy.budgeted(frac))
    assert geo.is_identity and tm.geometry_seconds(geo) == 0.0
    assert "buffer copies" in geo.summary()
    # a faster machine (time model) affords transforms under the same budget
    fast = TransformTimeModel(seconds_per_pass=1e-13, seconds_per_pass_large=1e-13, flops_per_second=1e15,
                              seconds_per_segment=1e-12)
    assert not select(layout, factors, SelectivePolicy.budgeted(frac, time_model=fast)).is_identity


def test_unbudgeted_policy_is_unchanged_by_the_new_fields(rng):
    layout = Layout([("w", (96, 128)), ("b", (96,))])
    factors = _factors(rng, layout)
    a = select(layout, factors, SelectivePolicy(min_size=1024, max_rank=32, budget=None))
    b = select(layout, factors, SelectivePolicy(min_size=1024, max_rank=32, budget=None, ranks=64, bandwidth=1.0))
    assert a == b and not a["w"].is_identity
    with pytest.raises(ValueError):
        SelectivePolicy(budget=-1.0)


# ------------------------------------------------------------------ MPI == simulator
@pytest.mark.mpi
def test_mpi_study_equals_the_simulator(rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    seed = comm.bcast(_seed(rng), root=0)  # rank 0's replayable seed (the rng fixture prints it)
    case = fid.synthetic_case([(40, 56), (24, 40)], cond=1e3, spectrum="exp", ranks=p, steps=2, seed=seed)
    methods = fid.default_methods(ranks=(4,), extra_policies={"budget": SelectivePolicy.budgeted(1.0)})
    rows = fid.evaluate(case, methods, comm)
    ok = comm.bcast(None if rows is None else all(r["mpi_equals_sim"] for r in rows))
    if comm.Get_rank() == 0:
        assert len(rows) == len(methods)
        assert {r["method"] for r in rows if not r["mpi_equals_sim"]} == set()
    else:
        assert rows is None
    assert ok


@pytest.mark.mpi
def test_mpi_formats_study_equals_the_simulator_for_every_algorithm(rng):
    """4-bit and MX formats, stochastic rounding, ring / direct / hierarchical (nodes of 2 where P
    is even): every row's MPI result equals the simulator's bit for bit."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    seed = comm.bcast(_seed(rng), root=0)
    case = fid.synthetic_case([(40, 56), (24, 40)], cond=1e3, spectrum="power", ranks=p, steps=2, seed=seed)
    methods = fid.format_methods(["nvfp4", "mxfp8"], ["nearest", "stochastic"], (4,), seed=seed)
    cache: dict = {}
    for alg in ["ring", "direct"] + (["hierarchical:2"] if p % 2 == 0 else []):
        rows = fid.evaluate(case, methods, comm, algorithm=alg, cache=cache)
        ok = comm.bcast(None if rows is None else all(r["mpi_equals_sim"] for r in rows))
        if comm.Get_rank() == 0:
            assert len(rows) == len(methods) and all(r["algorithm"] == alg for r in rows)
            assert {r["method"] for r in rows if not r["mpi_equals_sim"]} == set(), alg
        assert ok


def test_formats_study_runs_4bit_and_stochastic_and_gift_helps(tmp_path):
    out = tmp_path / "f.md"
    rc = fid.main(["synthetic", "--fmt", "nvfp4,mxfp4", "--rounding", "nearest,stochastic",
                   "--algos", "ring,hierarchical:2", "--shapes", "16x32,32x16", "--conds", "1e3",
                   "--spectra", "power", "--steps", "2", "--ks", "4", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "nvfp4 sr gift full" in text and "mxfp4 gift policy" in text and "hierarchical:2" in text
    case = fid.synthetic_case(((16, 32), (32, 16)), 1e3, "power", 4, 2, 0)
    rows = fid.evaluate(case, fid.format_methods(["nvfp4"], ["stochastic"], (4,)))
    by = {r["method"]: r for r in rows}
    assert by["nvfp4 sr gift full"]["whitened"] < by["nvfp4 sr euclid"]["whitened"]
    assert by["nvfp4 sr gift full"]["bytes_per_value"] == by["nvfp4 sr euclid"]["bytes_per_value"]


# ------------------------------------------------------------------ real gradients: formats x roundings x algorithms
def _capture(path, rng, shapes=((24, 40), (40, 24)), ranks=4, steps=2):
    """A small file in the layout of ``python -m studies.gradients``: weights w{i} with Kronecker-
    structured per-rank gradients, a bias each, EMA and capture factors that differ."""
    names, shp, factors, parts = [], [], {}, [[[] for _ in range(ranks)] for _ in range(steps)]
    for i, (m, n) in enumerate(shapes):
        a, g = fid.kron_factor(rng, n, 1e3), fid.kron_factor(rng, m, 1e3)
        ra, rg = fid._sqrt_psd(a), fid._sqrt_psd(g)
        names += [f"w{i}", f"b{i}"]
        shp += [[m, n], [m]]
        factors[f"A/w{i}"], factors[f"G/w{i}"] = a.astype(np.float32), g.astype(np.float32)
        factors[f"MA/w{i}"] = (a + 0.05 * np.eye(n)).astype(np.float32)
        factors[f"MG/w{i}"] = (g + 0.05 * np.eye(m)).astype(np.float32)
        for s in range(steps):
            common = rg @ rng.standard_normal((m, n)) @ ra
            for r in range(ranks):
                w = common + 0.5 * rg @ rng.standard_normal((m, n)) @ ra
                parts[s][r] += [w.ravel(), 0.1 * rng.standard_normal(m)]
    grads = np.array([[np.concatenate(pr) for pr in st] for st in parts], np.float32)
    info = {"config": "test", "parameters": int(grads.shape[2]), "train_steps": 0, "batch": ranks}
    np.savez(path, names=np.array(names), shapes=json.dumps(shp), info=json.dumps(info), grads=grads, **factors)
    return path


def test_real_formats_study_runs_every_algorithm_and_matches_the_simulator(tmp_path, rng):
    from giftcomm.reference import simulate_allreduce, simulate_gift_allreduce
    from studies.gradients import load_case

    data = _capture(tmp_path / "grads.npz", rng)
    seed = _seed(rng)
    out, js = tmp_path / "r.md", tmp_path / "r.json"
    algos = ("ring", "direct", "hierarchical:2")
    rc = fid.main(["real", "--data", str(data), "--fmt", "nvfp4,mxfp8", "--rounding", "nearest,stochastic",
                   "--algos", ",".join(algos), "--ks", "4", "--steps", "1", "--seed", str(seed), "--no-progress",
                   "--out", str(out), "--json", str(js)])
    assert rc == 0
    res = json.loads(js.read_text())["results"]
    assert [r["algorithm"] for r in res] == list(algos)
    for block in res:
        rows = block["rows"]
        assert {(r["fmt"], r["rounding"], r["geometry"]) for r in rows} == {
            (f, rnd, g) for f in ("nvfp4", "mxfp8") for rnd in ("nearest", "stochastic")
            for g in ("euclid", "gift full", "gift k=4", "gift policy")}
        assert all(r["algorithm"] == block["algorithm"] for r in rows)
        assert all(len(r["per_step_rel_l2"]) == 1 and np.isfinite(r["whitened"]) for r in rows)
        by = {(r["fmt"], r["rounding"], r["geometry"]): r for r in rows}
        for f in ("nvfp4", "mxfp8"):
            for g in ("euclid", "gift full"):
                assert by[(f, "stochastic", g)]["rel_l2"] != by[(f, "nearest", g)]["rel_l2"]
            # at the same bytes, full whitening beats Euclidean in the whitened norm
            for rnd in ("nearest", "stochastic"):
                assert by[(f, rnd, "gift full")]["bytes_per_value"] == by[(f, rnd, "euclid")]["bytes_per_value"]
                assert by[(f, rnd, "gift full")]["whitened"] < by[(f, rnd, "euclid")]["whitened"]
    ring = {(r["fmt"], r["rounding"], r["geometry"]): r["rel_l2"] for r in res[0]["rows"]}
    hier = {(r["fmt"], r["rounding"], r["geometry"]): r["rel_l2"] for r in res[2]["rows"]}
    assert all(ring[k] != hier[k] for k in ring)
    # one case recomputed by hand: the simulator with the algorithm, node size and step-0 seed
    case = load_case(str(data))
    step = case.grads[0]
    exact = np.mean([x.astype(np.float64) for x in step], axis=0)
    y = simulate_allreduce(step, fmt="nvfp4", op="avg", algorithm="hierarchical", local_size=2,
                           rounding="stochastic", seed=seed)[0]
    row = next(r for r in res[2]["rows"] if r["method"] == "nvfp4 sr euclid")
    assert row["rel_l2"] == fid.relative_l2(y, exact)
    from giftcomm.geometry import Geometry

    geo = Geometry.from_kfac(case.layout, fid._spectra(case.factors), damping=1e-3)  # the study's --damping
    y = simulate_gift_allreduce(step, geo, fmt="mxfp8", op="avg", algorithm="direct", rounding="stochastic",
                                seed=seed)[0]
    row = next(r for r in res[1]["rows"] if r["method"] == "mxfp8 sr gift full")
    assert row["rel_l2"] == fid.relative_l2(y, exact)
    text = out.read_text()
    assert "| direct | mxfp8 | stochastic |" in text and "hierarchical:2" in text and "commit:" in text
    assert "### Errors per format, rounding and algorithm" in text


def test_earlier_option_spellings_still_parse():
    a = fid._parser().parse_args(["real", "--fmts", "e4m3", "--roundings", "stochastic", "--algorithms", "direct"])
    b = fid._parser().parse_args(["real", "--fmt", "e4m3", "--rounding", "stochastic", "--algos", "direct"])
    assert (a.fmt, a.rounding, a.algos) == (b.fmt, b.rounding, b.algos) == ("e4m3", "stochastic", "direct")
    assert fid._parser().parse_args(["real", "--algorithm", "direct"]).algos == "direct"
    assert fid._parser().parse_args(["real"]).algos == "ring"
    with pytest.raises(ValueError, match="unknown rounding"):
        fid.format_methods(["e4m3"], ["up"])


def test_segments_subset_keeps_the_matching_tensors_values_and_factors(tmp_path, rng):
    from studies.gradients import load_case

    case = load_case(str(_capture(tmp_path / "grads.npz", rng, shapes=((8, 12), (12, 8), (6, 10)))))
    sub = fid.subset_case(case, r"^(w1|b1|w2)$")
    assert [s.name for s in sub.layout] == ["w1", "b1", "w2"] and set(sub.factors) == set(sub.metric) == {"w1", "w2"}
    for step, full in zip(sub.grads, case.grads):
        for x, y in zip(step, full):
            for seg in sub.layout:
                src = case.layout[seg.name]
                assert np.array_equal(x[seg.offset:seg.stop], y[src.offset:src.stop])
    assert "3 of 6 tensors" in sub.name and sub.ranks == case.ranks
    rows = fid.evaluate(sub, fid.format_methods(["mxfp4"], ["nearest"], (2,)))
    assert {r["method"] for r in rows} == {"mxfp4 euclid", "mxfp4 gift full", "mxfp4 gift k=2", "mxfp4 gift policy"}
    with pytest.raises(ValueError, match="no segment"):
        fid.subset_case(case, "nothing")


def test_policy_budget_sweep_spans_identity_to_full_whitening(rng):
    """studies.policy_budget on a small synthetic case: a zero budget is the identity (nothing
    recovered, no time), a huge one recovers nearly all of full whitening's reduction, every
    budgeted geometry's predicted time stays within its budget, and full whitening is 100%."""
    from studies.policy_budget import measure, tables

    case = fid.synthetic_case([(64, 96), (96, 64)], cond=1e4, spectrum="power", ranks=2, steps=1, seed=_seed(rng))
    res = measure(case, ["nvfp4"], budgets=(0.0, 0.1, 100.0), repeats=1)
    geos = {r["geometry"]: r for r in res["geometries"]}
    assert geos["budget 0"]["transformed"] == 0 and geos["budget 0"]["predicted_ms"] == 0.0
    assert geos["budget 100"]["transformed"] == geos["full whitening"]["transformed"] == 2
    for f in (0.0, 0.1, 100.0):
        row = geos[f"budget {f:g}" + (" (default)" if f == 0.1 else "")]
        assert row["predicted_ms"] <= f * row["fp8_ms"] * (1 + 1e-9)
    err = {e["geometry"]: e for e in res["errors"]}
    assert err["budget 0"]["recovered"] == 0.0 and err["budget 0"]["whitened"] == err["euclid"]["whitened"]
    assert err["full whitening"]["recovered"] == 1.0 and err["full whitening"]["recovered_pooled"] == 1.0
    assert err["budget 100"]["recovered"] > 0.9
    assert err["full whitening"]["whitened"] < err["euclid"]["whitened"] / 5
    assert abs(sum(w["share"] for w in res["weights"]) - 1.0) < 1e-9 and len(res["weights"]) == 2
    assert "| budget 0.1 (default) |" in tables(res, ["nvfp4"])
