"""The native path (``algorithm="native"``: the transport's own allreduce, giftcomm.collectives.native):
equal to its definition (simulate_allreduce(..., algorithm="native"), MPICH's recursive-doubling
order) bit for bit on the loopback and under mpiexec; bit-identical on every rank even when the
transport's own sum is not (the first-call digest check); ``auto`` takes it exactly where the cost
model predicts it faster than every compressed row, never with ``allow_native=False``; bad input
and disagreeing options raise the same error on every rank."""
from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import pytest
from conftest import PASS_THROUGH_FORMATS, assert_same_error, covering, outcomes, same

import giftcomm as gc
from giftcomm.algorithms import TABLE
from giftcomm.cost.calibration import forget_calibration
from giftcomm.cost.model import Calibration, LinkCost, Topology, candidate_times, choose
from giftcomm.formats import get_format
from giftcomm.reference import simulate_allreduce, simulate_reduce_scatter
from giftcomm.transport.base import tree_sum

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format
PASS_THROUGH = PASS_THROUGH_FORMATS

DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16, np.float16]


def _wide(rng, p: int, n: int, dtype) -> list[np.ndarray]:
    """Values over a wide exponent range, so that the order of the additions shows in the bits."""
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(dtype) for _ in range(p)]


@pytest.mark.parametrize("fmt, dtype, p, op", covering(["e4m3", *PASS_THROUGH], DTYPES, [1, 2, 3, 4, 5], ["sum", "avg"]))
def test_native_equals_its_definition_on_the_loopback(rng, fmt, dtype, p, op):
    xs = _wide(rng, p, 1000, dtype)
    kept = [x.copy() for x in xs]
    want = simulate_allreduce(xs, fmt=fmt, op=op, algorithm="native")
    got = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt, op=op, algorithm="native"))
    assert all(same(g, w) for g, w in zip(got, want))
    assert all(same(x, k) for x, k in zip(xs, kept))
    shards = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=fmt, op=op,
                                                                 algorithm="native", layout="blocks"))
    assert all(same(s, w) for s, w in zip(shards, simulate_reduce_scatter(xs, fmt=fmt, op=op, algorithm="native")))


def test_native_writes_out_and_leaves_the_input(rng):
    xs = _wide(rng, 3, 64, np.float32)
    outs = [np.full((8, 8), np.nan, np.float32) for _ in xs]

    def body(t):
        return gc.allreduce(xs[t.rank].reshape(8, 8), comm=t, algorithm="native", out=outs[t.rank])

    got = gc.LoopbackGroup(3).run(body)
    want = simulate_allreduce(xs, algorithm="native")[0].reshape(8, 8)
    assert all(g is o and same(g, want) for g, o in zip(got, outs))


def test_the_definition_is_mpich_recursive_doubling():
    """Reference and transport default (written independently) agree; and the order is the
    tree: at P = 4, (x0 + x1) + (x2 + x3), not the rank-order sum; at P = 3, (x0 + x1) + x2."""
    big, one = np.float32(2**25), np.float32(1)
    xs4 = [np.array([v], np.float32) for v in (big, one, -big, one)]
    assert simulate_allreduce(xs4, fmt="fp32", algorithm="native")[0][0] == 0  # (2^25+1) + (-2^25+1): both round
    assert ((big + one) - big) + one == 1  # the rank-order sum would give 1
    rng = np.random.default_rng(5)
    for p in range(1, 9):
        for kind, dtype in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
            xs = _wide(rng, p, 257, dtype)
            fmt = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[kind]
            assert same(tree_sum(xs, kind).astype(np.float32), simulate_allreduce(xs, fmt=fmt, algorithm="native")[0]
                        .astype(np.float32))


def test_ranks_get_identical_bytes_even_when_the_transport_does_not(rng, caplog):
    """A transport whose own sum differs on rank 1: the first call's digest check sees it, rank 0's
    result is broadcast (this call and later ones of that size), and one warning says so."""
    class Skewed(gc.LoopbackGroup):
        pass

    xs = _wide(rng, 3, 100, np.float32)

    def body(t):
        own = type(t).native_sum

        def skewed(buf, kind, into=None):
            total = own(t, buf, kind, into)
            if t.rank == 1:
                total[0] = np.nextafter(total[0], np.inf)
            return total

        t.native_sum = skewed  # type: ignore[method-assign]
        first = gc.allreduce(xs[t.rank], comm=t, algorithm="native")
        second = gc.allreduce(xs[t.rank], comm=t, algorithm="native")
        return first, second, dict(t.state.native)

    with caplog.at_level(logging.WARNING, logger="giftcomm"):
        res = Skewed(3).run(body)
    want = simulate_allreduce(xs, algorithm="native")[0]
    assert all(same(f, want) and same(s, want) for f, s, _ in res)
    assert all(state == {(100, "float32"): False} for _, _, state in res)
    assert sum("gave the ranks different bytes" in r.message for r in caplog.records) == 3  # once per rank


def _cal(native_alpha: float, native_beta: float) -> Calibration:
    return Calibration(shm=LinkCost(2e-6, 1 / 10e9), net=LinkCost(1e-5, 1 / 1.25e8), encode_rate=2e9, decode_rate=3e9,
                       fused_rate=1.5e9, accumulate_rate=3e9, overlap=0.0, native_alpha=native_alpha,
                       native_beta=native_beta, native_half_beta=2 * native_beta)


def test_auto_takes_native_exactly_where_predicted_faster():
    wins, loses = _cal(3e-6, 0.0), _cal(1e-3, 1e-9)
    for p in (2, 4):
        topo = Topology(p, 1, p)
        for n in (1 << 8, 1 << 16, 1 << 22):
            for cal in (wins, loses):
                times = candidate_times(n, topo, "e4m3", 256, cal)
                faster = times["native"] < min(t for a, t in times.items() if a != "native")
                assert (choose(n, topo, E4M3, 256, cal) == "native") == faster
                assert choose(n, topo, E4M3, 256, cal, native=False) != "native"
                assert "native" not in candidate_times(n, topo, "e4m3", 256, cal, native=False)
    big = 1 << 22
    assert choose(big, Topology(2, 1, 2), E4M3, 256, wins) == "native"
    assert choose(big, Topology(2, 1, 2), E4M3, 256, loses) != "native"
    assert choose(big, Topology(2, 1, 2), E4M3, 256, Calibration()) != "native"  # built-in defaults: compression


def test_native_prediction_is_the_documented_formula():
    cal = _cal(5e-6, 0.3e-9)
    n, p = 1 << 20, 4
    want = cal.call_overhead + 5e-6 + (p - 1) / p * n * 2 * (2 * cal.shm.beta + 0.6e-9)  # bf16: 2 bytes, half_beta
    from giftcomm.cost.model import predict

    assert predict("native", n, Topology(p, 1, p), get_format("bf16"), 256, cal) == pytest.approx(want)
    assert predict("native", n, Topology(p, 1, p), E4M3, 256, cal) > predict("native", n, Topology(p, 1, p), get_format("bf16"),
                                                                               256, cal)


def test_calibration_files_without_the_native_fields_keep_the_defaults():
    doc = {"shm": {"alpha": 1e-6, "beta": 1e-10}, "net": {"alpha": 1e-5, "beta": 1e-9}}
    cal = Calibration.from_dict(doc)
    default = Calibration()
    assert (cal.native_alpha, cal.native_beta, cal.native_half_beta) == (default.native_alpha, default.native_beta,
                                                                         default.native_half_beta)
    assert Calibration.from_dict({**doc, "native_alpha": 7e-6}).native_alpha == 7e-6
    with pytest.raises(ValueError, match="native_beta"):
        Calibration.from_dict({**doc, "native_beta": -1.0})


def test_auto_through_the_api_follows_the_calibration(rng, tmp_path, monkeypatch):
    """The same call takes native under a calibration where it wins (the result is the native
    definition, last_algorithm says so) and stays compressed with allow_native=False."""
    path = tmp_path / "cal.json"
    path.write_text(_cal(1e-7, 0.0).to_json())
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(path))
    forget_calibration()
    try:
        xs = _wide(rng, 2, 1 << 16, np.float32)

        def body(t):
            a = gc.allreduce(xs[t.rank], comm=t)
            first = gc.api.last_algorithm(t)[0]
            b = gc.allreduce(xs[t.rank], comm=t, allow_native=False)
            return a, first, b, gc.api.last_algorithm(t)[0]

        res = gc.LoopbackGroup(2).run(body)
        assert all(r[1] == "native" and same(r[0], simulate_allreduce(xs, algorithm="native")[0]) for r in res)
        assert all(r[3] != "native" and same(r[2], simulate_allreduce(xs, algorithm=r[3])[0]) for r in res)
    finally:
        monkeypatch.delenv("GIFTCOMM_CALIBRATION")
        forget_calibration()


def test_bad_native_options_raise_the_same_error_on_every_rank(rng):
    x = rng.standard_normal(32).astype(np.float32)
    errs = outcomes(3, lambda t: gc.allreduce(x, comm=t, algorithm="native", allow_native=False))
    assert_same_error(errs, ValueError, "allow_native=False")
    errs = outcomes(3, lambda t: gc.allreduce(x, comm=t, allow_native=None))
    assert_same_error(errs, ValueError, "allow_native must be True or False")
    errs = outcomes(3, lambda t: gc.allreduce(x, comm=t, algorithm="native" if t.rank == 1 else "ring"))
    assert_same_error(errs, ValueError, "ranks disagree")
    errs = outcomes(3, lambda t: gc.allreduce(x, comm=t, allow_native=t.rank != 2))
    assert_same_error(errs, ValueError, "ranks disagree")
    bad = [x, x.astype(np.int32), x]
    errs = outcomes(3, lambda t: gc.allreduce(bad[t.rank], comm=t, algorithm="native"))
    assert_same_error(errs, TypeError)


def test_native_row_is_in_the_table_and_not_giftcomms_wire():
    rows = [a for a in TABLE if a.native]
    assert [a.name for a in rows] == ["native"] and rows[0].scatter and rows[0].steps is None


@pytest.mark.mpi
def test_native_over_mpi_equals_its_definition():
    """MPI_Allreduce (and the 16-bit user operation) at this world size: equal to the definition
    bit for bit, the same bytes on every rank, the digest check passed."""
    from mpi4py import MPI

    from giftcomm.transport import resolve

    comm = MPI.COMM_WORLD
    t = resolve(comm)
    rng = np.random.default_rng(11)
    for n, fmt, dtype in ((7, "fp32", np.float32), (70_000, "e4m3", np.float32), (70_000, "bf16", np.float32),
                          (3_001, "fp16", np.float64)):
        xs = _wide(rng, comm.size, n, dtype)
        want = simulate_allreduce(xs, fmt=fmt, algorithm="native")[comm.rank]
        out = np.full_like(xs[comm.rank], np.nan)
        for _ in range(3):  # repeated: a cached plan's call (one node: one handshake, then MPI into out)
            got = gc.allreduce(xs[comm.rank], comm=comm, fmt=fmt, algorithm="native", out=out)
            assert got is out and same(got, want), (n, fmt)
        assert len(set(comm.allgather(got.tobytes()))) == 1
    assert all(t.state.native.values())


def test_adapters_log_their_path_once_per_bucket_size(rng, caplog, tmp_path, monkeypatch):
    """GradSync (auto per bucket) logs at INFO, once per bucket size and rank, the path each size
    took and why; a calibration where native wins makes the buckets take it and the log say so."""
    import torch

    from giftcomm.adapters.torch import GradSync

    path = tmp_path / "cal.json"
    path.write_text(_cal(1e-7, 0.0).to_json())
    monkeypatch.setenv("GIFTCOMM_CALIBRATION", str(path))
    forget_calibration()

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 16))

    models = [model(), model()]
    x = [torch.randn(4, 24, generator=torch.Generator().manual_seed(r)) for r in range(2)]

    def body(t):
        torch.set_num_threads(1)
        algos = []
        for allow in (True, False):
            sync = GradSync(models[t.rank], comm=t, bucket_mb=0.002, allow_native=allow)
            for _ in range(2):
                sync.zero_grad()
                models[t.rank](x[t.rank]).pow(2).mean().backward()
                sync.sync()
            algos.append((list(sync.algorithms), sorted({b.tensor.numel() for b in sync.buckets})))
        return algos

    try:
        with caplog.at_level(logging.INFO, logger="giftcomm.adapters"):
            res = gc.LoopbackGroup(2).run(body)
    finally:
        monkeypatch.delenv("GIFTCOMM_CALIBRATION")
        forget_calibration()
    (native_algos, sizes), (own_algos, _) = res[0]
    assert set(native_algos) == {"native"} and "native" not in own_algos and len(sizes) > 1
    told = [r.message for r in caplog.records if "GradSync" in r.message]
    assert len(told) == 2 * 2 * len(sizes)  # 2 ranks x 2 GradSyncs x each size once (not once per call)
    assert sum("take native" in m and "predicted: native" in m for m in told) == 2 * len(sizes)
    assert sum("allow_native=False" in m for m in told) == 2 * len(sizes)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("inplace", [False, True])
def test_repeated_native_calls_run_the_cached_plan_into_out(rng, p, inplace):
    """On one node a repeated native call runs its cached plan (one handshake in the channel, then
    the transport's sum straight into ``out``): the definition's bytes, every rank alike, ``out``
    returned (also when it is the input itself), and a mismatched call still agrees afresh."""
    xs = [_wide(rng, p, 700, np.float32) for _ in range(3)]

    def body(t):
        got = []
        for k in range(3):
            x = xs[k][t.rank].copy()
            out = x if inplace else np.full_like(x, np.nan)
            for op in ("sum", "avg"):
                y = gc.allreduce(xs[k][t.rank].copy() if op == "avg" else x, comm=t, algorithm="native", op=op,
                                 out=None if op == "avg" else out)
                got.append((y is out, y.copy(), op))
        return got, len(t.state.plan_cache)

    res = gc.LoopbackGroup(p, shared_memory=True).run(body)
    for k in range(3):
        want = {op: simulate_allreduce(xs[k], op=op, algorithm="native")[0] for op in ("sum", "avg")}
        for r in range(p):
            is_out, y, op = res[r][0][2 * k]
            assert is_out and same(y, want["sum"]), (r, k)
            _, y, op = res[r][0][2 * k + 1]
            assert same(y, want["avg"]), (r, k)
    assert all(r[1] == 2 for r in res)  # one plan per signature (out given / not), reused


def test_a_native_cached_call_meeting_another_signature_raises_on_every_rank(rng):
    xs = _wide(rng, 2, 64, np.float32)

    def body(t):
        gc.allreduce(xs[t.rank], comm=t, algorithm="native")  # cached everywhere
        n = 64 if t.rank == 0 else 32
        return gc.allreduce(xs[t.rank][:n], comm=t, algorithm="native")

    errors = outcomes(2, body, group=lambda p: gc.LoopbackGroup(p, shared_memory=True))
    assert all(type(e) is ValueError and "disagree" in str(e) for e in errors), errors
