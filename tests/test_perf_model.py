"""The calibration fit, the calibration file, the scaling projections and the error study."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from giftcomm.algorithms import TABLE
from giftcomm.cost import model as costmodel
from giftcomm.cost.model import Calibration, LinkCost, Topology, load_calibration, predict
from giftcomm.formats import get_format
from giftcomm.perf import calibrate
from studies import errors, model

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- calibrate

def synthetic_times(rng, alpha, beta, sizes, noise=0.02):
    """One-way times t = alpha + beta * size, with multiplicative noise of +-noise."""
    s = np.asarray(sizes, np.float64)
    return (alpha + beta * s) * (1 + noise * rng.uniform(-1, 1, s.size))


def test_fit_line_is_exact_on_a_line():
    x = np.array([1.0, 2.0, 5.0, 9.0])
    intercept, slope = calibrate.fit_line(x, 3.0 + 0.5 * x)
    assert intercept == pytest.approx(3.0) and slope == pytest.approx(0.5)


@pytest.mark.parametrize("alpha,beta", [(2e-6, 1 / 3e9), (60e-6, 1 / 1.2e8), (1e-5, 1 / 1.25e9)])
def test_fit_link_recovers_alpha_and_beta(rng, alpha, beta):
    small = [8, 64, 256, 1024]
    large = [1 << k for k in range(18, 25)]  # 256 KiB .. 16 MiB
    sizes = small + large
    link = calibrate.fit_link(sizes, synthetic_times(rng, alpha, beta, sizes), small_max=1024, large_min=1 << 18)
    assert link.beta == pytest.approx(beta, rel=0.05)
    assert link.alpha == pytest.approx(alpha, rel=0.05)


def test_fit_link_exact_without_noise():
    sizes = [8, 512, 1 << 20, 1 << 22, 1 << 24]
    link = calibrate.fit_link(sizes, [5e-6 + s * 1e-9 for s in sizes], small_max=512, large_min=1 << 20)
    assert link.alpha == pytest.approx(5e-6, rel=1e-9) and link.beta == pytest.approx(1e-9, rel=1e-9)


def test_fit_link_of_a_falling_slope_still_loads(rng):
    """Noise can make the large messages look faster than the small ones: the fitted constants
    are clamped to what a calibration file may hold, so the file calibrate writes loads."""
    sizes = [8, 64, 1 << 18, 1 << 19, 1 << 20]
    times = sorted(rng.uniform(1e-6, 1e-4, len(sizes)), reverse=True)  # falling with size
    link = calibrate.fit_link(sizes, times, small_max=1024, large_min=1 << 18)
    assert Calibration.from_dict({"shm": asdict(link), "net": asdict(link)}).net == link


def test_fit_link_needs_both_groups():
    with pytest.raises(ValueError):
        calibrate.fit_link([1 << 20, 1 << 21], [1e-3, 2e-3], small_max=1024, large_min=1 << 20)
    with pytest.raises(ValueError):
        calibrate.fit_link([8, 1 << 20], [1e-6, 1e-3], small_max=1024, large_min=1 << 20)


def test_calibration_file_round_trips_through_load_calibration(tmp_path, monkeypatch):
    cal = calibrate.build_calibration(
        Calibration(), {"shm": LinkCost(1.5e-6, 2.5e-10), "net": LinkCost(4e-5, 8e-9)},
        {"encode": 2.1e9, "decode": 3.2e9, "fused": 9.1e8, "accumulate": 2.2e9}, source="test")
    path = tmp_path / "cal.json"
    path.write_text(calibrate.calibration_json(cal, {"P": 2, "sizes": [8, 16]}))
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(path))
    assert costmodel.calibration_path() == path
    got = load_calibration()
    assert got.shm == cal.shm and got.net == cal.net
    assert (got.encode_rate, got.decode_rate, got.fused_rate, got.accumulate_rate) == (2.1e9, 3.2e9, 9.1e8, 2.2e9)
    assert got.source == str(path)
    # the predictions use it
    topo = Topology(4, 1, 4)
    assert predict("ring", 1 << 20, topo, E4M3) == predict("ring", 1 << 20, topo, E4M3, cal=got)


def test_build_calibration_keeps_what_was_not_measured():
    prev = Calibration(net=LinkCost(7e-5, 1e-8), fused_rate=123.0)
    cal = calibrate.build_calibration(prev, {"shm": LinkCost(1e-6, 1e-10)}, None, source="x")
    assert cal.net == prev.net and cal.fused_rate == 123.0 and cal.shm == LinkCost(1e-6, 1e-10)


def test_calibrate_command_under_mpiexec_writes_a_loadable_file(tmp_path):
    """The real command at P = 2, tiny sizes; nodes of 1 rank: the net class is measured, the shm
    class (no two ranks on one node) keeps its previous value."""
    out = tmp_path / "cal.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "giftcomm.perf.calibrate", "--out", str(out),
           "--local-size", "1", "--small", "8,64", "--large", "64K,256K", "--budget", "0.01",
           "--reps", "20", "--codec-elems", "64K"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    printed = json.loads(res.stdout)
    assert json.loads(out.read_text()) == printed
    assert printed["measured"]["P"] == 2 and printed["measured"]["nodes"] == [0, 1]
    env_cal = Calibration.from_dict(printed)
    # The net class was measured: its raw one-way times are there and positive. The fitted
    # constants are only required to be finite and within the file bounds: on a loaded 2-core
    # machine the least-squares slope through a few tiny messages can come out flat (beta is then
    # clamped to the smallest value a calibration file may hold, so the file still loads).
    raw = printed["measured"]["net"]
    assert raw["pair"] == [0, 1] and raw["sizes"] == [8, 64, 65536, 131072, 262144]
    assert len(raw["one_way_s"]) == len(raw["sizes"])
    assert all(t > 0 for t in raw["one_way_s"])
    assert "shm" not in printed["measured"] and any(n.startswith("shm:") for n in printed["measured"]["notes"])
    for link in (env_cal.shm, env_cal.net):
        assert np.isfinite([link.alpha, link.beta]).all() and link.alpha >= 0 and link.beta >= 0
    assert min(env_cal.encode_rate, env_cal.decode_rate, env_cal.fused_rate, env_cal.accumulate_rate) > 0


# ----------------------------------------------------------------------------- projections

@pytest.fixture(scope="module")
def projection():
    return model.project_rows()


def test_projection_is_monotone_in_link_rate(projection):
    idx = {(r.model, r.gpus, r.algorithm, r.fmt, r.rate_gbit): r.seconds for r in projection}
    rates = sorted({r.rate_gbit for r in projection})
    for key in {k[:4] for k in idx}:
        times = [idx[(*key, rate)] for rate in rates]
        assert all(a > b for a, b in zip(times, times[1:])), (key, times)


def test_projection_is_monotone_in_bytes(projection):
    idx = {(r.model, r.gpus, r.algorithm, r.rate_gbit, r.fmt): r.seconds for r in projection}
    for key in {k[:4] for k in idx}:
        assert idx[(*key, "e4m3")] < idx[(*key, "bf16")] < idx[(*key, "fp32")], key
        assert idx[(*key, "gift")] > idx[(*key, "e4m3")]  # the transform costs something


def test_projection_grows_with_the_model(projection):
    idx = {(r.model, r.gpus, r.algorithm, r.rate_gbit, r.fmt): r.seconds for r in projection}
    for (m, *rest), s in idx.items():
        if m == "llama-300m":
            assert idx[("llama-600m", *rest)] > s


def test_model_parameter_counts_are_the_stated_classes():
    small, large = model.model_params("llama-300m")["total"], model.model_params("llama-600m")["total"]
    assert 2.5e8 < small < 4e8 and 5.5e8 < large < 7e8


def test_gpu_calibration_rate_is_the_link_rate():
    cal = model.gpu_calibration(200)
    assert 1 / cal.net.beta == pytest.approx(25e9)  # 200 Gbit/s = 25 GB/s


# ----------------------------------------------------------------------------- error study

@pytest.mark.parametrize("dist", errors.DISTS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_direct_is_at_least_as_faithful_as_the_ring(dist, fmt):
    rows = errors.study([2, 3, 4, 8], fmts=(fmt,), dists=(dist,), algos=("ring", "direct"), n=4096, trials=1)
    err = {(r.p, r.algorithm): r.relerr for r in rows}
    for p in (2, 3, 4, 8):
        assert err[(p, "direct")] <= err[(p, "ring")] * (1 + 1e-12), (p, err)
    assert err[(8, "direct")] < 0.8 * err[(8, "ring")]  # P-1 requantizations vs one


def test_ring_error_grows_with_p():
    rows = errors.study([2, 8, 32], fmts=("e4m3",), dists=("gaussian",), algos=("ring",), n=4096, trials=1)
    e = [r.relerr for r in sorted(rows, key=lambda r: r.p)]
    assert e[0] < e[1] < e[2]


def test_at_p2_ring_and_direct_are_the_same_computation():
    xs = errors.make_inputs("heavy", 2, 1000, seed=3)
    assert errors.sim_error("heavy", "e4m3", 2, "ring", 1000, 3) == errors.sim_error("heavy", "e4m3", 2, "direct", 1000, 3)
    assert all(x.dtype == np.float32 and x.size == 1000 for x in xs)


def test_ordering_check_flags_an_inversion():
    rows = [errors.ErrorRow("gaussian", "e4m3", 8, "direct", None, 0.5),
            errors.ErrorRow("gaussian", "e4m3", 8, "ring", None, 0.1)]
    assert errors.ordering_check(rows) and not errors.ordering_check(rows[::-1][:1])


def test_fit_overheads_recovers_call_and_step():
    alpha = 2e-6
    steps = [calibrate.steps_of(a, 4) for a in ("ring", "direct", "doubling")]
    assert steps == [6, 6, 2]
    assert [calibrate.steps_of("doubling", p) for p in (2, 3, 5, 8)] == [1, 3, 4, 3]
    seconds = [60e-6 + k * (alpha + 25e-6) for k in steps]
    call, step = calibrate.fit_overheads(steps, seconds, alpha)
    assert call == pytest.approx(60e-6) and step == pytest.approx(25e-6)


def test_error_growth_predicts_the_simulated_errors():
    """relerr / sqrt(error_growth) is one constant (the format's eps) for every algorithm and P."""
    from giftcomm.cost.model import error_growth

    rows = errors.study([2, 4, 8, 16], fmts=("e4m3",), dists=("gaussian",), n=8192, trials=1)
    eps = [r.relerr / np.sqrt(error_growth(r.algorithm, errors._topo(r.p, r.local_size))) for r in rows]
    assert {r.algorithm for r in rows} == set(errors.ALGOS)
    assert max(eps) / min(eps) < 1.15, eps
    assert not errors.ordering_check(rows, error_growth)


def test_auto_prefers_the_more_faithful_algorithm_among_near_ties():
    from giftcomm.cost.model import choose, error_growth

    cal = Calibration(shm=LinkCost(1e-5, 1 / 5e9), net=LinkCost(5e-5, 1 / 1.25e8))
    for p in (3, 4, 8, 16):
        topo = Topology(p, 1, p)
        for n in (1 << 10, 1 << 16, 1 << 22):
            pick = choose(n, topo, E4M3, cal=cal, native=False)  # giftcomm's own rows (test_native: the native one)
            times = {a.name: predict(a.name, n, topo, E4M3, cal=cal) for a in TABLE
                     if a.auto and not a.needs_nodes and not a.native}
            near = [a for a, t in times.items() if t <= 1.10 * min(times.values())]
            assert pick in near
            assert error_growth(pick, topo) == min(error_growth(a, topo) for a in near)


def test_fit_overlap_inverts_the_prediction():
    from dataclasses import replace

    cal = Calibration(shm=LinkCost(2e-6, 1 / 2e9), fused_rate=1e9, encode_rate=2e9, decode_rate=2e9)
    topo, n = Topology(2, 1, 2), 1 << 22
    full = predict("ring", n, topo, E4M3, cal=replace(cal, overlap=1.0))
    none = predict("ring", n, topo, E4M3, cal=replace(cal, overlap=0.0))
    assert none > full
    for ov in (0.0, 0.3, 1.0):
        measured = predict("ring", n, topo, E4M3, cal=replace(cal, overlap=ov))
        assert calibrate.fit_overlap(measured, full, none) == pytest.approx(ov)
    assert calibrate.fit_overlap(10 * none, full, none) == 0.0 and calibrate.fit_overlap(0.0, full, none) == 1.0


def test_phase_breakdown_script_accounts_for_every_part_of_a_call():
    """perf/phase_breakdown.py (the 4 MiB P = 2 diagnostic in docs/performance.md), one rank."""
    script = Path(__file__).resolve().parent.parent / "perf" / "phase_breakdown.py"
    res = subprocess.run([sys.executable, str(script), "--count", "5000", "--iters", "4"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("rank 0:"))
    parts = dict(zip(line.split()[2::2], map(float, line.split()[3::2])))
    # the timers really sit on the calls the collective makes (one encode and one decode per call at P = 1)
    for key in ("agreement", "encode", "decode"):
        assert 0 < parts.get(key, 0) < parts["total"], line


def test_model_validate_prints_the_native_baselines_beside_auto(tmp_path):
    """`studies model validate` at P = 2 times MPI_Allreduce fp32 and bf16 and giftcomm's bf16 ring
    in the same run and prints, per size, auto's pick against the fastest of them (xbest)."""
    out = tmp_path / "validate.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "studies", "model", "validate", "-b", "1K", "-e", "16K",
           "-f", "16", "--fmt", "e4m3", "--algos", "oneshot,ring,native", "--budget", "0.02", "--out", str(out)]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| e4m3 | 1") and ln.count("|") == 8]
    assert len(rows) == 2, out.read_text()
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert cells[2] in ("oneshot", "ring", "native")  # auto's pick was timed
        assert cells[5].split(" ms")[0].rsplit(" ", 1)[0] in ("MPI fp32", "MPI bf16", "bf16 ring")
        assert float(cells[6]) > 0


def test_gift_transform_time_takes_its_flops_as_a_parameter():
    """The projection reads no results file: the transform's GFLOP per step is a parameter whose
    default is the measured table (model.MEASURED_TRANSFORM_GFLOP)."""
    a = model.GPU_ASSUMPTIONS
    t, how = model.gift_transform_seconds("llama-300m")
    assert how.startswith("318 GFLOP from perf/results/geometry-cost.md")
    assert model.gift_transform_seconds("llama-300m", model.MEASURED_TRANSFORM_GFLOP[("llama-300m", 64)])[0] == t
    big = 50 * model.MEASURED_TRANSFORM_GFLOP[("llama-300m", 64)]  # compute-bound: the flops decide
    t2, how2 = model.gift_transform_seconds("llama-300m", big)
    assert t2 == pytest.approx(big * 1e9 / (a["gemm_TFLOPs"] * 1e12)) and "from the caller" in how2
    # a rank with no measurement: LowRankSide's flop formula
    t3, how3 = model.gift_transform_seconds("llama-300m", None, dict(a, transform_rank=8))
    assert "LowRankSide flop formula, k=8" in how3 and t3 > 0
    rows = model.project_rows(models=("llama-300m",), gpus=(8,), rates=(100,), algos=("ring",), fmts=("gift",),
                              transform_gflop={"llama-300m": big})
    base = model.project_rows(models=("llama-300m",), gpus=(8,), rates=(100,), algos=("ring",), fmts=("e4m3",))
    assert rows[0].seconds == pytest.approx(base[0].seconds + t2)
