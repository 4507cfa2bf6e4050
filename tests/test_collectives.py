"""The public collectives on every array backend and transport schedule, against the reference
simulations bit for bit.

One parametrisation (``path``) covers what varies: the array backend (NumPy; torch CPU tensors,
which come back as torch tensors; CuPy on a GPU) and the transport's schedule (PIPELINED over the
host loopback; GROUPED over the device loopback, which queues every operation and issues the
queue as one group on the first wait, with NCCL's semantics: a pipelined order would deadlock
there). reduce_scatter, allgather, allreduce with every algorithm and gift_allreduce with a
geometry must equal giftcomm.reference's simulations; out= and in-place; bad or mismatched
arguments raise the same exception on every rank and leave the inputs untouched; the
communication pattern of a grouped hop; under mpiexec (``-m mpi``) the grouped schedule over the
CUDA-aware MPI transport with fake ``__cuda_array_interface__`` buffers. On a machine with a CUDA
GPU the "cupy" path runs the same tests on the device (tests/test_gpu.py has the kernel tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    ALGORITHM_CHOICES,
    ALGORITHM_NAMES,
    FORMAT_NAMES,
    SCALED_FORMATS,
    SCATTER_ALGORITHMS,
    block_for,
    covering,
    local_sizes,
    same,
)
from conftest import outcomes as shared_outcomes
from test_gpu_plumbing import FakeDeviceArray

import giftcomm as gc
from giftcomm.cuda import available as cuda_available
from giftcomm.geometry import Geometry
from giftcomm.reference import simulate_allgather, simulate_allreduce, simulate_gift_allreduce, simulate_reduce_scatter
from giftcomm.reference.simulate import resolve_algorithm
from giftcomm.transport import GROUPED, Request, Transport
from giftcomm.transport.device_loopback import DeviceLoopbackGroup
from studies.device.collective_check import KFAC_LAYOUT, random_kfac_geometry

PS = [1, 2, 3, 4, 5, 6, 8]
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]
# (n, block): partial last blocks, fewer blocks than ranks, odd blocks (fixed-block formats: their own)
CASES = [(1000, 32), (515, 256), (7, 3), (300, 64), (41, 8)]


@dataclass(frozen=True)
class Path:
    """An array backend over a transport schedule: ``to(x)`` makes the caller's array from NumPy,
    ``back(y)`` reads a result into NumPy (asserting it is of the caller's kind), ``run(p, fn)``
    runs ``fn(transport)`` on P virtual ranks."""

    name: str
    group: Callable[[int], Any]
    to: Callable[[np.ndarray], Any]
    back: Callable[[Any], np.ndarray]

    def run(self, p: int, fn: Callable[[Transport], Any]) -> list[Any]:
        return self.group(p).run(fn)


def _numpy_back(y: Any) -> np.ndarray:
    assert isinstance(y, np.ndarray), type(y)
    return y


def _torch_path() -> Path:
    import torch

    def to(x: np.ndarray) -> Any:
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.copy())

    def back(y: Any) -> np.ndarray:
        assert isinstance(y, torch.Tensor) and y.device.type == "cpu", type(y)
        if y.dtype == torch.bfloat16:
            return y.view(torch.int16).numpy().view(BF16)
        return y.numpy()

    return Path("torch-cpu", gc.LoopbackGroup, to, back)


def _cupy_path() -> Path:
    if not cuda_available():
        pytest.skip("no CUDA GPU: the cupy path runs on a machine with one")
    import cupy

    def to(x: np.ndarray) -> Any:
        return cupy.asarray(x.view(np.uint16)).view(np.uint16) if x.dtype == BF16 else cupy.asarray(x)

    def back(y: Any) -> np.ndarray:
        assert isinstance(y, cupy.ndarray), type(y)
        return cupy.asnumpy(y)

    return Path("cupy", DeviceLoopbackGroup, to, back)


PATH_NAMES = ["numpy-pipelined", "numpy-grouped", "torch-cpu", "cupy"]


@pytest.fixture(params=PATH_NAMES)
def path(request) -> Path:
    if request.param == "numpy-pipelined":
        return Path(request.param, gc.LoopbackGroup, lambda x: x, _numpy_back)
    if request.param == "numpy-grouped":
        return Path(request.param, DeviceLoopbackGroup, lambda x: x, _numpy_back)
    if request.param == "torch-cpu":
        return _torch_path()
    return _cupy_path()


def inputs(rng, p, n, dtype, spread=8.0):
    """Per-rank inputs of varied magnitude (block scales differ) in ``dtype``."""
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-spread, spread, n) / 4)).astype(dtype) for _ in range(p)]


def outcomes(p, fn, group=DeviceLoopbackGroup):
    """Every rank's result or exception, on the grouped schedule unless told otherwise."""
    return shared_outcomes(p, fn, group)


def _rounding(fmt: str, i: int, rng) -> tuple[str, int | None]:
    """Stochastic rounding (a random seed) on every other case of a block-scaled format."""
    if fmt in SCALED_FORMATS and i % 2:
        return "stochastic", int(rng.integers(0, 2**63))
    return "nearest", None


# ----------------------------------------------------------------------- reduce_scatter
SCATTER_CASES = covering(FORMAT_NAMES, SCATTER_ALGORITHMS, PS, CASES)


@pytest.mark.parametrize("fmt, algorithm, p, case", SCATTER_CASES)
def test_reduce_scatter_matches_simulation(rng, path, fmt, algorithm, p, case):
    """Every format through every reduce-scatter algorithm (P and the size rotating)."""
    n, block = case
    block = block_for(fmt, block)
    i = SCATTER_CASES.index((fmt, algorithm, p, case))
    for dtype in (DTYPES[i % 4], DTYPES[(i + 1) % 4]):
        xs = inputs(rng, p, n, dtype)
        args = [path.to(x) for x in xs]
        op = ("sum", "avg")[int(rng.integers(2))]
        rounding, seed = _rounding(fmt, i, rng)
        got = path.run(p, lambda t: gc.reduce_scatter(args[t.rank], comm=t, op=op, fmt=fmt, block=block,
                                                      algorithm=algorithm, rounding=rounding, seed=seed))
        want = simulate_reduce_scatter(xs, fmt, block, op, algorithm, rounding=rounding, seed=seed)
        bounds = gc.chunk_bounds(n, p, gc.formats.resolve_block(fmt, block))
        for r in range(p):
            g = path.back(got[r])
            assert g.shape == (bounds[r + 1] - bounds[r],)
            assert same(g, want[r]), (n, block, dtype, op, rounding, r)
        assert all(same(path.back(a), x) for a, x in zip(args, xs))  # inputs untouched


# ---------------------------------------------------------------------------- allgather
@pytest.mark.parametrize("fmt, p", [(f, PS[i % len(PS)]) for i, f in enumerate(FORMAT_NAMES)])
def test_allgather_unequal_shards_matches_simulation(rng, path, fmt, p):
    for i, dtype in enumerate(DTYPES):
        block = block_for(fmt, CASES[i][1])
        unit = gc.formats.resolve_block(fmt, block)
        shards = [inputs(rng, 1, int(rng.integers(0, 3 * unit + 2)), dtype)[0] for _ in range(p)]
        if p > 1:
            shards[int(rng.integers(p))] = np.zeros(0, dtype)  # an empty shard somewhere
        args = [path.to(s) for s in shards]
        rounding, seed = _rounding(fmt, i, rng)
        got = path.run(p, lambda t: gc.allgather(args[t.rank], comm=t, fmt=fmt, block=block, rounding=rounding,
                                                 seed=seed))
        want = simulate_allgather(shards, fmt, block, rounding=rounding, seed=seed)
        assert all(same(path.back(g), w) for g, w in zip(got, want)), (block, dtype, rounding)


@pytest.mark.parametrize("algorithm, p, fmt", covering(SCATTER_ALGORITHMS, PS, FORMAT_NAMES))
def test_allgather_of_reduce_scatter_is_allreduce(rng, path, algorithm, p, fmt):
    block = block_for(fmt, 64)
    for dtype in (np.float32, np.float64):
        xs = inputs(rng, p, 2049, dtype)
        args = [path.to(x) for x in xs]

        def both(t):
            shard = gc.reduce_scatter(args[t.rank], comm=t, fmt=fmt, block=block, algorithm=algorithm)
            return (gc.allgather(shard, comm=t, fmt=fmt, block=block),
                    gc.allreduce(args[t.rank], comm=t, fmt=fmt, block=block, algorithm=algorithm))

        want = simulate_allreduce(xs, fmt, block, "sum", algorithm)
        for (gathered, reduced), w in zip(path.run(p, both), want):
            assert same(path.back(gathered), w) and same(path.back(reduced), w)


# ---------------------------------------------------------------------------- allreduce
ALLREDUCE_CASES = covering(FORMAT_NAMES, ALGORITHM_CHOICES, PS, CASES)


@pytest.mark.parametrize("fmt, algorithm, p, case", ALLREDUCE_CASES)
def test_allreduce_matches_simulation(rng, path, fmt, algorithm, p, case):
    """Every format through every algorithm (and ``auto``) on this path: a covering design, P and
    the size rotating so that every algorithm and every format meets every P; the rows that
    need nodes run with every node size dividing P."""
    n, block = case
    block = block_for(fmt, block)
    i = ALLREDUCE_CASES.index((fmt, algorithm, p, case))
    for dtype in (DTYPES[i % 4], DTYPES[(i + 2) % 4]):
        for local_size in local_sizes(algorithm, p):
            xs = [x.reshape(-1, 1) if n % 2 else x.reshape(2, -1) for x in inputs(rng, p, n, dtype)]
            args = [path.to(x) for x in xs]
            op = ("sum", "avg")[int(rng.integers(2))]
            unit = gc.formats.resolve_block(fmt, block)
            slice_elems = int(rng.choice([unit, 4 * unit, 1 << 18]))
            rounding, seed = _rounding(fmt, i, rng)
            got = path.run(p, lambda t: gc.allreduce(args[t.rank], comm=t, op=op, fmt=fmt, block=block,
                                                     algorithm=algorithm, local_size=local_size,
                                                     slice_elems=slice_elems, rounding=rounding, seed=seed))
            ran = resolve_algorithm(algorithm, n, p, local_size, fmt, block)
            want = simulate_allreduce(xs, fmt, block, op, ran, local_size=local_size, rounding=rounding, seed=seed)
            assert all(same(path.back(g), w) for g, w in zip(got, want)), (n, block, dtype, op, ran, local_size)
            assert all(same(path.back(a), x) for a, x in zip(args, xs))


def test_default_auto_matches_the_simulations_default(rng):
    """No ``algorithm=`` at all: the cost model's choice, the same one the simulation makes."""
    for n in (10, 5000, 300000):
        xs = inputs(rng, 4, n, np.float32)
        outs = gc.LoopbackGroup(4).run(lambda t: gc.allreduce(xs[t.rank], comm=t))
        assert same(outs[0], simulate_allreduce(xs)[0])


@pytest.mark.parametrize("fmt, p", [(f, (2, 3, 4, 6)[i % 4]) for i, f in enumerate(FORMAT_NAMES)])
def test_pipelined_bytes_do_not_depend_on_the_slice_size(rng, fmt, p):
    """Slices are whole slice units (blocks; nvfp4: its 1024-value scale groups), so the bytes of
    every block do not depend on how a hop is cut (38 blocks, the last one partial)."""
    f = gc.formats.get_format(fmt)
    block = block_for(fmt, 32)
    unit = f.slice_unit(gc.formats.resolve_block(fmt, block))
    # an adaptive row's unit is a frame of up to 16M values: slices are whole chunks here
    n = (unit if f.adaptive is None else 2 * gc.formats.resolve_block(f, block)) * 37 + 5
    dtype = (np.float32, np.float64, np.float16)[FORMAT_NAMES.index(fmt) % 3]
    xs = inputs(rng, p, n, dtype)
    rounding, seed = _rounding(fmt, FORMAT_NAMES.index(fmt), rng)
    kw = dict(fmt=fmt, block=block, rounding=rounding, seed=seed)
    want = simulate_allreduce(xs, fmt, block, "sum", "ring", rounding=rounding, seed=seed)
    want_rs = simulate_reduce_scatter(xs, fmt, block, "sum", "ring", rounding=rounding, seed=seed)
    for slice_elems in (1, 32, 96, 1000, 1 << 18):
        outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, algorithm="ring",
                                                              slice_elems=slice_elems, **kw))
        assert all(same(o, w) for o, w in zip(outs, want)), slice_elems
        shards = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, slice_elems=slice_elems,
                                                                     **kw))
        assert all(same(s, w) for s, w in zip(shards, want_rs)), slice_elems


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_shapes_and_accuracy(rng, dtype, op):
    """A 3-D input keeps its shape, equals the simulation, and e4m3 on three ranks lands within
    10% of the exact sum."""
    p = 3
    xs = [rng.standard_normal((5, 7, 11)).astype(dtype) for _ in range(p)]
    outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, op=op, block=16))
    assert all(same(o, w) for o, w in zip(outs, simulate_allreduce(xs, block=16, op=op)))
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0) / (p if op == "avg" else 1)
    assert np.linalg.norm(outs[0].astype(np.float64) - exact) / np.linalg.norm(exact) < 0.1


def test_input_is_not_modified_and_non_contiguous_input_is_accepted(rng):
    p = 3
    base = [rng.standard_normal((40, 30)).astype(np.float32) for _ in range(p)]
    views = [b[::2, 1::3] for b in base]
    before = [b.copy() for b in base]
    outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(views[t.rank], comm=t))
    assert all(same(o, w) for o, w in zip(outs, simulate_allreduce([np.ascontiguousarray(v) for v in views])))
    assert all(np.array_equal(b, c) for b, c in zip(base, before))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_on_one_rank_is_non_finite_everywhere(rng, fmt, bad):
    """A NaN or Inf on one rank: non-finite at its place on every rank; a block-scaled format
    poisons exactly the block holding it (the format's own block), nothing else."""
    p = 4
    xs = inputs(rng, p, 2000, np.float32, spread=1)
    xs[2][777] = bad
    outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=fmt, algorithm="ring"))
    block = gc.formats.resolve_block(fmt, None)
    lo = 777 // block * block
    for o in outs:
        assert not np.isfinite(o[777])
        if fmt in SCALED_FORMATS:
            assert np.all(np.isnan(o[lo:lo + block]))
            assert np.all(np.isfinite(o[:lo])) and np.all(np.isfinite(o[lo + block:]))
    assert same(outs[0], simulate_allreduce(xs, fmt=fmt, algorithm="ring")[0])


def test_stochastic_rounding_is_reproducible_identical_everywhere_and_seeded(rng):
    p, n = 4, 4096
    xs = inputs(rng, p, n, np.float32, spread=1)
    run = lambda seed: gc.LoopbackGroup(p).run(  # noqa: E731
        lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="nvfp4", rounding="stochastic", seed=seed, allow_native=False))
    a, b, c = run(1), run(1), run(2)
    assert all(same(x, a[0]) for x in a) and all(same(x, y) for x, y in zip(a, b))
    assert not same(a[0], c[0])
    exact = np.sum(xs, axis=0)
    mean = np.mean([run(s)[0] for s in range(40)], axis=0)
    nearest = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt="nvfp4", allow_native=False))[0]
    # averaging over seeds removes most of stochastic rounding's error, not nearest rounding's bias
    assert np.linalg.norm(mean - exact) < 0.5 * np.linalg.norm(nearest - exact)


def test_empty_and_single_values(rng, path):
    for p in (1, 3):
        for n in (0, 1):
            xs = inputs(rng, p, n, np.float32)
            args = [path.to(x) for x in xs]
            got = path.run(p, lambda t: gc.allreduce(args[t.rank], comm=t, op="avg", algorithm="direct"))
            assert all(same(path.back(g), w) for g, w in zip(got, simulate_allreduce(xs, "e4m3", 256, "avg", "direct")))
            got = path.run(p, lambda t: gc.reduce_scatter(args[t.rank], comm=t))
            assert all(same(path.back(g), w) for g, w in zip(got, simulate_reduce_scatter(xs, "e4m3", 256, "sum")))


# ------------------------------------------------------------------------ gift_allreduce
SIZE = sum(int(np.prod(shape)) for _, shape in KFAC_LAYOUT)
GIFT_CASES = [(a, (1, 2, 3, 5)[(i + k) % 4], FORMAT_NAMES[(2 * i + k) % len(FORMAT_NAMES)])
              for i, a in enumerate(ALGORITHM_NAMES) for k in range(2)]


@pytest.mark.parametrize("algorithm, p, fmt", GIFT_CASES)
def test_gift_allreduce_geometry_matches_simulation(rng, path, algorithm, p, fmt):
    geo = random_kfac_geometry(rng, rank=6)
    assert not geo.is_identity
    i = GIFT_CASES.index((algorithm, p, fmt))
    block = block_for(fmt, 64)
    for dtype, op in ((np.float32, "sum"), ((np.float64, BF16)[i % 2], "avg")):
        local_size = local_sizes(algorithm, p)[-1]
        xs = inputs(rng, p, SIZE, dtype, spread=2)
        args = [path.to(x) for x in xs]
        rounding, seed = _rounding(fmt, i, rng)
        got = path.run(p, lambda t: gc.gift_allreduce(args[t.rank], geo, comm=t, op=op, fmt=fmt, block=block,
                                                      algorithm=algorithm, local_size=local_size,
                                                      rounding=rounding, seed=seed))
        want = simulate_gift_allreduce(xs, geo, fmt, block, op, algorithm, local_size, rounding=rounding, seed=seed)
        assert all(same(path.back(g), w) for g, w in zip(got, want)), (dtype, op)
        assert all(same(path.back(a), x) for a, x in zip(args, xs))


def test_no_geometry_or_the_identity_is_plain_allreduce(rng, path):
    p = 3
    xs = inputs(rng, p, SIZE, np.float32)
    args = [path.to(x) for x in xs]
    want = simulate_allreduce(xs, "e4m3", 256, "sum", "ring")
    for geo in (None, Geometry.identity(KFAC_LAYOUT)):
        got = path.run(p, lambda t: gc.gift_allreduce(args[t.rank], geo, comm=t, algorithm="ring"))
        assert all(same(path.back(g), w) for g, w in zip(got, want))


# ---------------------------------------------------------------------------------- out=
def test_out_arguments(rng, path):
    p, n, block = 3, 777, 32
    xs = inputs(rng, p, n, np.float32)
    args = [path.to(x) for x in xs]
    want = simulate_allreduce(xs, "e4m3", block, "avg", "direct")

    def allreduce_into_out(t):
        out = path.to(np.full(n, np.nan, np.float32))
        res = gc.allreduce(args[t.rank], comm=t, op="avg", block=block, out=out, algorithm="direct")
        return res is out, out

    assert all(is_out and same(path.back(o), w) for (is_out, o), w in zip(path.run(p, allreduce_into_out), want))
    inplace = [path.to(x) for x in xs]  # out= the input itself
    got = path.run(p, lambda t: gc.allreduce(inplace[t.rank], comm=t, op="avg", block=block, out=inplace[t.rank],
                                             algorithm="direct"))
    assert all(g is i and same(path.back(g), w) for g, i, w in zip(got, inplace, want))

    bounds = gc.chunk_bounds(n, p, block)
    shards = [path.to(np.empty(int(bounds[r + 1] - bounds[r]), np.float32)) for r in range(p)]
    got = path.run(p, lambda t: gc.reduce_scatter(args[t.rank], comm=t, block=block, out=shards[t.rank]))
    assert all(g is s and same(path.back(g), w) for g, s, w in zip(got, shards, simulate_reduce_scatter(xs, "e4m3", block)))

    outs = [path.to(np.empty(n, np.float32)) for _ in range(p)]
    got = path.run(p, lambda t: gc.allgather(shards[t.rank], comm=t, block=block, out=outs[t.rank]))
    want_g = simulate_allgather([path.back(s) for s in shards], "e4m3", block)
    assert all(g is o and same(path.back(g), w) for g, o, w in zip(got, outs, want_g))


@pytest.mark.parametrize("algorithm", ALGORITHM_CHOICES)
def test_out_of_any_layout_for_every_algorithm(rng, algorithm):
    """out= fresh, the input itself, and a Fortran-order (not C-contiguous) array, for every
    algorithm (ring and direct decode straight into a contiguous float32 out; the rest copy)."""
    p = 4
    i = ALGORITHM_CHOICES.index(algorithm)
    shape, op = ((1000,), (25, 40))[i % 2], ("sum", "avg")[i // 2 % 2]
    local_size = local_sizes(algorithm, p)[-1]
    xs = inputs(rng, p, int(np.prod(shape)), np.float32)
    xs = [x.reshape(shape) for x in xs]
    ran = resolve_algorithm(algorithm, xs[0].size, p, local_size, "e4m3")
    want = simulate_allreduce(xs, op=op, algorithm=ran, local_size=local_size)
    kw = dict(op=op, algorithm=algorithm, local_size=local_size)
    run = gc.LoopbackGroup(p).run
    for order in ("C", "F"):
        outs = [np.empty(shape, np.float32, order=order) for _ in range(p)]
        got = run(lambda t: gc.allreduce(xs[t.rank], comm=t, out=outs[t.rank], **kw))
        assert all(g is o for g, o in zip(got, outs))
        assert all(np.array_equal(o.view(np.uint32), w.view(np.uint32)) for o, w in zip(outs, want)), order
    inplace = [x.copy() for x in xs]
    run(lambda t: gc.allreduce(inplace[t.rank], comm=t, out=inplace[t.rank], **kw))
    assert all(same(o, w) for o, w in zip(inplace, want))


# --------------------------------------------------- the communication pattern; MPI plumbing
class _LoggedRequest(Request):
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def wait(self):
        self.log.append(("wait",))
        self.inner.wait()


class Recording(Transport):
    """Wraps a transport with its schedule and memory, logging the point-to-point calls; with
    ``fake=True`` every buffer reaches the inner transport as a FakeDeviceArray (CUDA-aware MPI
    plumbing)."""

    def __init__(self, inner, fake=False):
        self.inner, self.rank, self.size, self.fake, self.log = inner, inner.rank, inner.size, fake, []
        self.schedule, self.memory = inner.schedule, "any"

    def _pass(self, kind, buf, peer, tag):
        self.log.append((kind, peer))
        op = self.inner.isend if kind == "send" else self.inner.irecv
        return _LoggedRequest(op(FakeDeviceArray(buf) if self.fake else buf, peer, tag), self.log)

    def isend(self, buf, dest, tag=0):
        return self._pass("send", buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        return self._pass("recv", buf, source, tag)

    def allgather_int64(self, vec):
        return self.inner.allgather_int64(vec)

    def allgather_object(self, obj):
        return self.inner.allgather_object(obj)


@pytest.mark.parametrize("slice_elems", [32, 1 << 18])
def test_grouped_hops_queue_their_receives_and_sends_together(rng, slice_elems):
    """Over a GROUPED transport every group issued holds one hop: the ring's receives from the left
    and sends to the right (one of each per slice, the forwards of the previous hop beside the
    receives of the next), the direct algorithm's receives from and sends to every peer (an
    all-to-all in one group)."""
    p, n, block = 5, 1000, 32
    xs = inputs(rng, p, n, np.float32)
    group = DeviceLoopbackGroup(p)
    issued: list[list[list[tuple[str, int]]]] = [[] for _ in range(p)]
    for t in group.transports:
        def flush(t=t, inner=t.flush):
            issued[t.rank].append(sorted((op.kind, op.peer) for op in t._queue))
            inner()
        t.flush = flush
    for algorithm in ("direct", "ring"):
        for log in issued:
            log.clear()
        group.run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, block=block, algorithm=algorithm,
                                              slice_elems=slice_elems))
        for r, groups in enumerate(issued):
            left, right = (r - 1) % p, (r + 1) % p
            if algorithm == "direct":
                others = sorted(set(range(p)) - {r})
                assert len(groups) == 1
                for kind in ("recv", "send"):
                    assert sorted({peer for k, peer in groups[0] if k == kind}) == others
            else:
                assert len(groups) == p - 1
                for g in groups:
                    assert set(g) == {("recv", left), ("send", right)}


@pytest.mark.mpi
def test_grouped_schedule_over_cuda_aware_mpi_plumbing():
    """The public API over the CUDA-aware MPI transport (GROUPED) with fake device buffers (MPICH
    reads the host memory behind the pointers): reduce_scatter, allgather, the direct and
    doubling allreduces and gift_allreduce with a geometry equal the simulations on every rank."""
    from mpi4py import MPI

    from giftcomm.transport.device_mpi import DeviceMpiTransport

    inner = DeviceMpiTransport(MPI.COMM_WORLD, require_cuda_aware=False)
    t = Recording(inner, fake=True)
    assert t.schedule == GROUPED
    p, r = t.size, t.rank
    rng = np.random.default_rng(4321)  # the same inputs on every rank
    xs = inputs(rng, p, 3001, np.float32)
    for algorithm in ("ring", "direct"):
        shard = gc.reduce_scatter(xs[r], comm=t, block=64, algorithm=algorithm)
        assert same(shard, simulate_reduce_scatter(xs, "e4m3", 64, "sum", algorithm)[r])
        full = gc.allgather(shard, comm=t, block=64)
        assert same(full, simulate_allreduce(xs, "e4m3", 64, "sum", algorithm)[r])
    got = gc.allreduce(xs[r], comm=t, block=64, algorithm="doubling")
    assert same(got, simulate_allreduce(xs, "e4m3", 64, "sum", "doubling")[r])
    geo = random_kfac_geometry(rng, rank=4)
    gs = inputs(rng, p, geo.size, np.float32, spread=2)
    got = gc.gift_allreduce(gs[r], geo, comm=t, op="avg", block=64, algorithm="direct")
    assert same(got, simulate_gift_allreduce(gs, geo, "e4m3", 64, "avg", "direct")[r])
    if p > 1:
        with pytest.raises(ValueError, match="ranks disagree on count"):
            gc.allreduce(xs[r][: 100 + r], comm=t, block=64)
    inner.free()


# ------------------------------------------------------------------ threads on one transport
def test_two_threads_on_one_communicator_never_mix_data(rng):
    """Two threads per rank call collectives on one transport. Calls are serialised per transport
    and the caller's thread name is agreed on: a call paired with another thread's call on a peer
    raises on both ranks; every call that returns has the right data."""
    import threading
    import time

    p, rounds = 2, 12
    data = {name: inputs(rng, p, 3000, np.float32) for name in ("A", "B")}
    want = {name: simulate_allreduce(xs, "e4m3", 256, "sum", "ring") for name, xs in data.items()}
    results: dict[tuple[int, str], list] = {}

    def rank_body(t):
        def worker(name):
            got = results.setdefault((t.rank, name), [])
            # a random pause before each call: the two threads' order on a rank is then random,
            # not an alternation that could pair the ranks' threads wrongly in every round
            jitter = np.random.default_rng([t.rank, ord(name)])
            for _ in range(rounds):
                time.sleep(jitter.uniform(0, 2e-3))
                try:
                    got.append(gc.allreduce(data[name][t.rank], comm=t, algorithm="ring"))
                except ValueError as exc:
                    got.append(exc)

        # rank 1 starts its threads in the other order, so that pairings differ
        order = ("A", "B") if t.rank == 0 else ("B", "A")
        threads = [threading.Thread(target=worker, args=(name,), name=name) for name in order]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    gc.LoopbackGroup(p).run(rank_body)
    returned = raised = 0
    for (rank, name), got in results.items():
        assert len(got) == rounds
        for g in got:
            if isinstance(g, ValueError):
                assert "disagree on caller" in str(g)
                raised += 1
            else:
                assert same(g, want[name][rank]), (rank, name)
                returned += 1
    assert returned + raised == 2 * p * rounds and returned > 0
    print(f"{returned} calls returned, {raised} raised")
