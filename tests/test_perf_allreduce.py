"""The allreduce sweep of ``python -m giftcomm.perf allreduce`` (the main job) under mpiexec, at
every world size tests/run_all.sh runs (P = 1 included: one rank still quantizes once)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from giftcomm.perf import collective_bench as cb
from giftcomm.perf.collective_bench import run_allreduce_sweep

pytestmark = pytest.mark.mpi


def _shared_seed(comm, rng) -> int:
    """Rank 0's replayable seed (the rng fixture prints it), the same on every rank."""
    return comm.bcast(int(rng.integers(1 << 30)), root=0)


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_sweep_rows_match_the_simulation(op, rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p = comm.size
    seed = _shared_seed(comm, rng)
    sizes, fmts = [4096, 65536], ["e4m3", "bf16", "fp32"]
    seen = []
    # allow_native=False: the fidelity checks below are about the formats (auto may otherwise take
    # the transport's own float32 allreduce; test_native.py checks that path)
    rows = run_allreduce_sweep(comm, sizes, fmts, "float32", op, 256, iters=2, warmup=1, check=True,
                               seed=seed, progress=False, on_row=seen.append, baselines=cb.BASELINES,
                               allow_native=False)
    assert rows == seen
    assert [(r.size, r.fmt) for r in rows] == [(s, f) for s in sizes for f in fmts + ["mpi", "mpibf", "bf16"]]
    for s in sizes:  # xbest: the fastest baseline's time over the row's, from this run's baselines
        here = [r for r in rows if r.size == s]
        best = min(r.time_us for r in here if cb.is_baseline(r))
        assert all(r.xbest == pytest.approx(best / r.time_us) for r in here)
        assert [cb.is_baseline(r) for r in here] == [False] * len(fmts) + [True] * 3
        assert here[-1].algorithm == "ring (baseline)"
    for r in rows:
        assert r.time_us > 0 and r.count == r.size // 4 and r.type == "float" and r.root == -1
        assert r.algbw == pytest.approx(r.size / (r.time_us * 1e-6) / 1e9)
        assert r.busbw == pytest.approx(r.algbw * 2 * (p - 1) / p)  # nccl-tests' allreduce busbw (0 at P = 1)
        # the bus bandwidth in bytes actually sent: FP8 ~1/4 of the float32 input bytes, bf16 1/2
        ratio = {"e4m3": (1 + 4 / 256) / 4, "bf16": 0.5, "fp32": 1.0, "mpi": 1.0, "mpibf": 0.5}[r.fmt]
        assert r.wirebw == pytest.approx(r.busbw * ratio)
        assert r.wrong == 0  # giftcomm rows: equal to the reference simulation, bit for bit, on every rank
        if r.fmt == "mpi":
            assert r.algorithm == "mpi" and r.relerr < 1e-6
        elif r.fmt == "mpibf":
            assert r.algorithm == "mpi" and r.relerr < 1e-2
        else:
            assert r.algorithm.replace(" (baseline)", "") in cb.ALGORITHMS[1:] and r.algorithm != "native"
    err = {r.fmt: r.relerr for r in rows if r.size == 65536 and not cb.is_baseline(r)}
    # FP8 errs more than bf16, bf16 more than fp32 (random normal data, well above rounding); at
    # P = 1 the single rank still encodes its buffer once, and fp32 is exact there
    assert err["e4m3"] > err["bf16"] > err["fp32"] >= 0
    assert 0.005 < err["e4m3"] < 0.1
    assert 2e-4 < err["bf16"] < 1e-2
    if p == 1:
        assert err["fp32"] == 0.0


def test_a_forced_algorithm_is_reported(rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows = run_allreduce_sweep(comm, [8192], ["e4m3"], "float32", "sum", 256, iters=1, warmup=0, check=True,
                               seed=_shared_seed(comm, rng), progress=False, on_row=lambda r: None,
                               algorithm="direct")
    assert rows[0].algorithm == "direct" and rows[0].wrong == 0


def test_command_prints_nccl_tests_columns_footer_and_json(tmp_path, capsys, rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = tmp_path / "sweep.json"
    rc = cb.main(["-b", "1K", "-e", "4K", "-f", "4", "--fmt", "e4m3,bf16", "-n", "1", "-w", "0",
                  "--seed", str(_shared_seed(comm, rng)), "--json", str(out), "--label", "t"])
    assert rc == 0
    if comm.rank != 0:
        return
    text = capsys.readouterr().out
    lines = text.splitlines()
    head = next(ln.split() for ln in lines if ln.startswith("#") and ln.split()[1:2] == ["size"])
    assert head[0] == "#" and head[1:10] == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
    assert head[10:] == ["fmt", "algo", "wirebw", "relerr", "maxabs", "xbest"]
    assert sum(bool(re.match(r"#\s+Rank\s+\d+ Group\s+0 Pid\s+\d+ on ", ln)) for ln in lines) == comm.size
    rows = [ln.split() for ln in lines if ln.split()[:1] and ln.split()[0].isdigit()]
    assert [(r[0], r[9]) for r in rows] == [(s, f) for s in ("1024", "4096")
                                            for f in ("e4m3", "bf16", "mpi", "mpibf", "bf16")]
    assert [r[10] for r in rows[:5]][2:] == ["mpi", "mpi", "ring_(baseline)"]
    assert max(float(r[14]) for r in rows[2:5]) == 1.0  # the fastest baseline
    assert all(r[8] == "0" for r in rows)
    assert "# Out of bounds values : 0 OK" in lines
    avg = next(ln for ln in lines if ln.startswith("# Avg bus bandwidth    :"))
    assert float(avg.split(":")[1]) >= 0
    doc = json.loads(out.read_text())
    assert doc["P"] == comm.size and doc["label"] == "t" and doc["out_of_bounds"] == 0
    assert doc["giftcomm_version"] and doc["mpi_library"] and doc["date"] and doc["hosts"]
    assert len(doc["placement"]) == comm.size
    assert [r["algorithm"] for r in doc["rows"] if r["fmt"] == "mpi"] == ["mpi", "mpi"]
    ours = [r["busbw"] for r in doc["rows"] if r["fmt"] not in ("mpi", "mpibf") and "baseline" not in r["algorithm"]]
    assert np.isclose(doc["avg_busbw"], np.mean(ours))


def test_check_off_reports_na(capsys, rng):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rc = cb.main(["-b", "1K", "-e", "1K", "--fmt", "e4m3", "-n", "1", "-w", "0", "-c", "0", "--baselines", "mpi",
                  "--seed", str(_shared_seed(comm, rng))])
    assert rc == 0
    if comm.rank == 0:
        lines = capsys.readouterr().out.splitlines()
        rows = [ln.split() for ln in lines if ln.split()[:1] and ln.split()[0].isdigit()]
        assert [r[8] for r in rows] == ["N/A", "N/A"]
        assert "# Out of bounds values : N/A OK" in lines
