"""giftcomm.perf.timing: the one timing helper of the benchmarks and studies, on a fake clock (so
every number is known) and through the scripts that load it by path."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from giftcomm.perf.timing import STATS, time_calls, time_rounds

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    """A clock whose repeats take the next of ``durations`` seconds; logs every event in order."""

    def __init__(self, durations, log):
        self.durations, self.log = list(durations), log

    def __call__(self, run):
        result = run()
        self.log.append("tick")
        return self.durations.pop(0), result


def test_time_calls_divides_each_repeat_by_its_calls_and_takes_the_statistic():
    rng = np.random.default_rng()
    durations = rng.uniform(1.0, 2.0, 7)
    for stat in STATS:
        log: list[str] = []
        got, last = time_calls(lambda: log.append("call") or len(log), 7, warmup=2, calls=5,
                               barrier=lambda: log.append("barrier"), stat=stat, clock=FakeClock(durations, log))
        assert got == pytest.approx(STATS[stat](durations / 5))
        # two warm-up calls, then per repeat: barrier, 5 calls, the clock
        assert log[:2] == ["call", "call"]
        assert log[2:] == (["barrier"] + ["call"] * 5 + ["tick"]) * 7
        assert last == len(log) - 1  # the last call's result (its own log position + 1)


def test_time_calls_budget_stops_early_but_not_before_min_iters():
    log: list[str] = []
    got, _ = time_calls(lambda: None, 50, warmup=0, budget_s=2.5, min_iters=2, clock=FakeClock([1.0] * 50, log))
    assert log.count("tick") == 3 and got == 1.0  # 1 + 1 + 1 >= 2.5 after the third
    log.clear()
    time_calls(lambda: None, 50, warmup=0, budget_s=0.0, min_iters=4, clock=FakeClock([1.0] * 50, log))
    assert log.count("tick") == 4


def test_time_rounds_interleaves_the_contenders_and_keeps_them_apart():
    rng = np.random.default_rng()
    rounds, calls = 5, 3
    durations = rng.uniform(1.0, 2.0, (rounds, 2))
    log: list[str] = []
    a, b = time_rounds([lambda: log.append("a"), lambda: log.append("b")], rounds, calls=calls, warmup=1,
                       clock=FakeClock(durations.reshape(-1), log))
    assert log[:2] == ["a", "b"]  # one warm-up call each
    assert log[2:] == (["a"] * calls + ["tick"] + ["b"] * calls + ["tick"]) * rounds
    assert a == pytest.approx(float(np.median(durations[:, 0])) / calls)
    assert b == pytest.approx(float(np.median(durations[:, 1])) / calls)


def test_device_timer_reads_cuda_events_or_the_host_clock_to_a_synchronize():
    """giftcomm.perf.device_bench.event_timer on a stand-in for CuPy's events: milliseconds, the
    median over reps, warm-up calls untimed, the device synchronized before every repeat."""
    from giftcomm.perf.device_bench import event_timer

    log: list[str] = []
    elapsed = iter([3.0, 1.0, 2.0])  # ms between the events of each repeat

    class FakeEvent:
        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("event sync")

    class FakeDevice:
        def synchronize(self):
            log.append("device sync")

    class Cuda:
        Event, Device = FakeEvent, FakeDevice

        @staticmethod
        def get_elapsed_time(a, b):
            return next(elapsed)

    class Cp:
        cuda = Cuda

    # 4 back-to-back calls between each pair of events: the median of 3, 1, 2 ms over 4 calls
    assert event_timer(Cp, 2, 3, calls=4)(lambda: log.append("call")) == pytest.approx(0.5)
    assert log[:2] == ["call", "call"]
    assert log[2:] == ["device sync", "record"] + ["call"] * 4 + ["record", "event sync"] * 1 + \
        (["device sync", "record"] + ["call"] * 4 + ["record", "event sync"]) * 2
    log.clear()
    wall = event_timer(Cp, 0, 2, wall=True, calls=1)(lambda: log.append("call"))
    assert log == ["device sync", "record", "call", "record", "device sync"] * 2 and 0 <= wall < 1e3


def test_the_real_clock_measures_elapsed_time():
    import time

    got, _ = time_calls(lambda: time.sleep(0.002), 3, warmup=0)
    assert 0.002 <= got < 0.5


def test_an_unknown_statistic_is_refused():
    with pytest.raises(ValueError, match="stat must be one of"):
        time_calls(lambda: None, 1, stat="mode")
    with pytest.raises(ValueError, match="stat must be one of"):
        time_rounds([lambda: None], 1, stat="mode")


@pytest.mark.parametrize("script, args, pattern", [
    ("perf/small_calls.py", ["--sizes", "1K", "--calls", "5"], r"^ +1024 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+x +[0-9.]+x  \w+"),
])
def test_side_by_side_scripts_run_one_rank(script, args, pattern, tmp_path):
    """The script prints its one line per size with the helper (the two-tree comparisons are
    ``python -m giftcomm.perf side-by-side``: tests/test_perf_cli.py)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / script), *args], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if not ln.startswith("#")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), res.stdout


def _check_step_json(path, groups: set[str]) -> list[dict]:
    """A step benchmark's ``--json`` file: a row per (mode, group) with the given groups in every
    mode, compute-only sends nothing, and each overhead is the step minus compute-only's."""
    result = json.loads(path.read_text())
    rows = result["rows"]
    modes = {r["mode"] for r in rows}
    assert modes and all({r["group"] for r in rows if r["mode"] == m} == groups for m in modes), rows
    for r in rows:
        compute = next(c for c in rows if c["mode"] == r["mode"] and c["group"] == "compute-only")
        assert r["step_ms"] > 0 and r["overhead_ms"] == pytest.approx(r["step_ms"] - compute["step_ms"])
        sends = r["group"] != "compute-only" and result["world"] > 1  # one rank sends nothing
        assert (r["bytes_per_step"] > 0) == sends, r
    return rows


@pytest.mark.parametrize("script, rows, groups", [
    ("perf/ddp_step.py", ("gloo", "fp16 hook", "giftcomm e4m3", "giftcomm nvfp4"),
     {"compute-only", "gloo", "fp16 hook", "giftcomm e4m3", "giftcomm nvfp4"}),
    ("perf/fsdp_step.py", ("fsdp fp32", "fsdp bf16", "giftcomm e4m3", "giftcomm nvfp4"),
     {"compute-only", "gloo", "fsdp bf16", "giftcomm e4m3", "giftcomm nvfp4"}),
])
def test_torch_step_scripts_run_one_rank(script, rows, groups, tmp_path):
    """The FSDP2 and DDP side-by-side scripts (perf/torch_bench.py's launch through MPI and a file
    rendezvous, as on the netbed) print one row per configuration and giftcomm's breakdown, and
    write the rows with a compute-only step as JSON."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / script), "--rendezvous", str(tmp_path / "rdzv"), "--width", "64",
                          "--layers", "2", "--steps", "1", "--rounds", "2", "--fmts", "e4m3,nvfp4",
                          "--json", str(tmp_path / "rows.json")], env=env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    _check_step_json(tmp_path / "rows.json", groups)
    number = r" +[0-9.]+"
    for name in rows:
        assert re.search(rf"^{name}{number}{number} +[0-9]+%( +([0-9.]+x|-)){{2}} +[0-9.]+x$", res.stdout, re.M), \
            res.stdout
    assert re.search(r"^giftcomm e4m3 .*per step \(medians, rank 0\).* codec [0-9.]+, waiting", res.stdout, re.M), \
        res.stdout


def _two_ranks(script: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``perf/SCRIPT`` under ``mpiexec -n 2`` as on the netbed (a file rendezvous in tmp_path),
    with ``--json tmp_path/rows.json``; fails with the job's output unless it exits 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(ROOT / "perf" / script), "--rendezvous",
                          str(tmp_path / "rdzv"), *args, "--json", str(tmp_path / "rows.json")], env=env,
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-8000:]
    return res


def test_torchtitan_step_script_runs_two_ranks(tmp_path):
    """perf/torchtitan_step.py as on the netbed (mpiexec, a file rendezvous), at P = 2 on a tiny
    step (seq_len 64, local batch 1, one round of one step): a row per configuration, and
    giftcomm's e4m3 reduce-scatters send about a quarter of stock's float32 bytes (1.0156 bytes a
    value against 4, plus the few small calls it sends uncompressed)."""
    res = _two_ranks("torchtitan_step.py", tmp_path, "--seq-len", "64", "--batch", "1", "--steps", "1", "--rounds", "1")
    _check_step_json(tmp_path / "rows.json", {"compute-only", "gloo", "giftcomm e4m3"})
    number = r" +([0-9.]+)"
    rows = {m[1]: [float(v) for v in m.groups()[1:]] for m in
            re.finditer(rf"^(torchtitan stock|giftcomm){number}{number}x{number}{number}x$", res.stdout, re.M)}
    assert set(rows) == {"torchtitan stock", "giftcomm"}, res.stdout
    assert rows["torchtitan stock"][1] == 1.0 and rows["torchtitan stock"][3] == 1.0
    assert 0.25 <= rows["giftcomm"][3] <= 0.27, res.stdout
    assert rows["giftcomm"][2] > 0


def test_megatron_step_script_runs_two_ranks(tmp_path):
    """perf/megatron_step.py as on the netbed (mpiexec, a file rendezvous) at P = 2 on a tiny
    model: every mode (with and without overlap_grad_reduce: a bucket per layer, each issued
    asynchronously during backward) with compute-only, gloo and giftcomm e4m3 rows in its JSON;
    e4m3 sends about a quarter of gloo's float32 bytes in each."""
    modes = ("allreduce", "dist-opt", "allreduce-overlap", "dist-opt-overlap")
    _two_ranks("megatron_step.py", tmp_path, "--width", "512", "--layers", "2", "--steps", "1", "--rounds", "1")
    rows = _check_step_json(tmp_path / "rows.json", {"compute-only", "gloo", "giftcomm e4m3"})
    assert {r["mode"] for r in rows} == set(modes)
    for mode in modes:
        by = {r["group"]: r for r in rows if r["mode"] == mode}
        assert 0.24 <= by["giftcomm e4m3"]["bytes_per_step"] / by["gloo"]["bytes_per_step"] <= 0.27, by


def test_jax_dist_bench_two_processes(tmp_path):
    """perf/jax_dist_bench.py under mpiexec (jax.distributed over CPU gloo collectives, a process
    per rank): giftcomm's jit psum equals the reference bit for bit across processes, and its
    bytes per device are e4m3's quarter of lax.psum's ring."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / "jax.json"
    res = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(ROOT / "perf" / "jax_dist_bench.py"), "--sizes", "4K",
                          "--fmts", "e4m3", "--algorithms", "ring", "--rounds", "1", "--reps", "1", "--port", "0",
                          "--json", str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"lax.psum", "e4m3/ring"} and rows["e4m3/ring"]["bit_exact"] == "yes"
    assert 0.25 <= rows["e4m3/ring"]["bytes_vs_base"] <= 0.26 and rows["e4m3/ring"]["ms_per_call"] > 0
