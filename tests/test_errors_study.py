"""The error-growth study (studies.errors) across wire formats and roundings: the row grid, the
seeding of stochastic rounding, equality with the reference simulator, the report and its JSON."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import SCALED_SAMPLE

from giftcomm.formats import get_format
from giftcomm.reference import simulate_allreduce
from studies import errors

# one xdist worker runs every test here (--dist loadgroup): the module-scoped fixture (the error grid)
# is then made once, not once per worker
pytestmark = pytest.mark.xdist_group("errors_study")

FMTS = tuple(SCALED_SAMPLE)
PS = (2, 4, 8)
ALGOS = ("ring", "direct", "hierarchical:2", "doubling")


def _seed(rng) -> int:
    return int(rng.integers(2**31))


@pytest.fixture(scope="module")
def grid():
    """One small run over every format and rounding (module-wide: the grid is the expensive part)."""
    seed = int(np.random.SeedSequence().entropy % (2**31))
    print(f"grid seed={seed}")
    rows = errors.study(PS, fmts=FMTS, dists=("gaussian", "heavy"), algos=ALGOS, n=2048, trials=2,
                        roundings=errors.ROUNDINGS, seed=seed)
    return seed, rows


def test_rows_cover_the_requested_grid_and_are_finite(grid):
    _, rows = grid
    want = {(d, f, rnd, p, a.partition(":")[0]) for d in ("gaussian", "heavy") for f in FMTS
            for rnd in errors.ROUNDINGS for p in PS for a in ALGOS}
    got = [(r.dist, r.fmt, r.rounding, r.p, r.algorithm) for r in rows]
    assert len(got) == len(set(got)) == len(want) and set(got) == want
    assert all(r.local_size == 2 for r in rows if r.algorithm == "hierarchical")
    assert all(r.local_size is None for r in rows if r.algorithm != "hierarchical")
    assert all(math.isfinite(r.relerr) and r.relerr > 0 for r in rows)
    # below the norm of the sum, except an adaptive row's: on these synthetic vectors every block
    # carries about the same energy, and the 2-bit tier (no zero level) takes the blocks its budget
    # cannot upgrade -- all of a 256-value chunk's at P = 8 (docs/wire-format.md, *Adaptive precision*)
    assert all(r.relerr < 1 for r in rows if get_format(r.fmt).adaptive is None)


def test_stochastic_differs_from_nearest_and_costs_error(grid):
    _, rows = grid
    idx = {(r.dist, r.fmt, r.rounding, r.p, r.algorithm): r.relerr for r in rows}
    ratios = [idx[(d, f, "stochastic", p, a)] / idx[(d, f, "nearest", p, a)]
              for (d, f, rnd, p, a) in idx if rnd == "nearest"]
    assert all(x != 1.0 for x in ratios)
    # unbiased but noisier: on average about sqrt(2) times the error of round-to-nearest
    assert 1.1 < float(np.median(ratios)) < 2.0, ratios


def test_four_bit_formats_are_coarser_than_eight_bit(grid):
    _, rows = grid
    for rnd in errors.ROUNDINGS:
        for p in PS:
            e = {r.fmt: r.relerr for r in rows if (r.dist, r.rounding, r.p, r.algorithm) == ("gaussian", rnd, p, "direct")}
            assert min(e["nvfp4"], e["mxfp4"]) > 2 * max(e["mxfp8"], e["e4m3"]), (rnd, p, e)


def test_direct_beats_the_ring_at_p8_in_every_format_and_rounding(grid):
    _, rows = grid
    idx = {(r.dist, r.fmt, r.rounding, r.p, r.algorithm): r.relerr for r in rows}
    for f in FMTS:
        for rnd in errors.ROUNDINGS:
            assert idx[("gaussian", f, rnd, 8, "direct")] < 0.85 * idx[("gaussian", f, rnd, 8, "ring")], (f, rnd)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("algo", ["ring", "hierarchical:2"])
def test_sim_error_equals_simulate_allreduce_with_the_trial_seed(rng, fmt, algo):
    seed, p, n = _seed(rng), 4, 3000
    xs = errors.make_inputs("heavy", p, n, seed)
    name, k = algo.partition(":")[0], errors.local_size_for(algo, p)
    y = simulate_allreduce(xs, fmt=fmt, algorithm=name, local_size=k, rounding="stochastic", seed=seed)[0]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    want = float(np.linalg.norm(y.astype(np.float64) - exact) / np.linalg.norm(exact))
    assert errors.sim_error("heavy", fmt, p, algo, n, seed, k, "stochastic") == want
    # the study's mean over trials is the mean of exactly these calls (seeds seed, seed+1)
    row = errors.study([p], fmts=(fmt,), dists=("heavy",), algos=(algo,), n=n, trials=2,
                       roundings=("stochastic",), seed=seed)
    assert len(row) == 1
    other = errors.sim_error("heavy", fmt, p, algo, n, seed + 1, k, "stochastic")
    assert row[0].relerr == float(np.mean([want, other]))
    # another call seed moves the result; the same seed reproduces it
    y2 = simulate_allreduce(xs, fmt=fmt, algorithm=name, local_size=k, rounding="stochastic", seed=seed + 1)[0]
    y3 = simulate_allreduce(xs, fmt=fmt, algorithm=name, local_size=k, rounding="stochastic", seed=seed)[0]
    assert y.tobytes() != y2.tobytes() and y.tobytes() == y3.tobytes()


def test_unknown_algorithm_and_rounding_are_refused():
    with pytest.raises(ValueError, match="unknown algorithm"):
        errors.split_algo("tree")
    with pytest.raises(ValueError, match="node size"):
        errors.split_algo("ring:2")
    with pytest.raises(ValueError, match="unknown rounding"):
        errors.study([2], fmts=("e4m3",), dists=("gaussian",), algos=("ring",), n=64, trials=1, roundings=("up",))
    assert errors.local_size_for("hierarchical", 6) is None and errors.local_size_for("hierarchical:3", 6) == 3


def test_main_writes_rows_that_name_format_and_rounding(tmp_path, rng):
    seed = _seed(rng)
    out = tmp_path / "e.md"
    argv = ["--ps", "2,4", "--mpi-ps", "", "--fmt", "nvfp4,mxfp8", "--rounding", "nearest,stochastic",
            "--algos", "ring,direct,hierarchical:2", "--dists", "gaussian", "--n", "1024", "--trials", "1",
            "--seed", str(seed), "--no-progress", "--out", str(out)]
    assert errors.main(argv) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {(r["fmt"], r["rounding"]) for r in rows} == {(f, rnd) for f in ("nvfp4", "mxfp8")
                                                         for rnd in ("nearest", "stochastic")}
    assert len(rows) == 2 * 2 * 2 * 3
    again = errors.study([2, 4], fmts=("nvfp4", "mxfp8"), dists=("gaussian",), algos=("ring", "direct", "hierarchical:2"),
                         n=1024, trials=1, roundings=("nearest", "stochastic"), seed=seed)
    assert sorted(json.dumps(r, sort_keys=True) for r in rows) == sorted(
        json.dumps(errors.asdict(r), sort_keys=True) for r in again)
    text = out.read_text()
    assert "## gaussian, nvfp4, stochastic rounding" in text and "| gaussian | mxfp8 | stochastic |" in text
    assert "commit:" in text and f"--seed {seed}" in text
    saved = json.loads(out.with_suffix(".args.json").read_text())
    assert saved["argv"] == argv and saved["commit"]
    # re-rendering from the JSON gives the same tables (the timing sentence aside)
    md2 = tmp_path / "again.md"
    assert errors.main(["--from-json", str(out.with_suffix(".json")), "--out", str(md2)]) == 0
    strip = lambda t: [ln for ln in t.splitlines() if not ln.startswith("n = ")]  # noqa: E731
    assert strip(md2.read_text()) == strip(text)


def test_old_rows_without_rounding_still_render(tmp_path):
    """errors-study.json rows predate the rounding field: they read back as round-to-nearest."""
    old = [{"dist": "gaussian", "fmt": "e4m3", "p": 2, "algorithm": "ring", "local_size": None, "relerr": 0.03,
            "source": "sim", "identical": None}]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    (tmp_path / "old.args.json").write_text(json.dumps(["--ps", "2", "--fmt", "e4m3"]))
    assert errors.main(["--from-json", str(path), "--out", str(tmp_path / "old.md")]) == 0
    assert "## gaussian, e4m3" in (tmp_path / "old.md").read_text()
