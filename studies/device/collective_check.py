"""The device collectives against the reference simulations, on any backend (a device_check section).

:func:`collective_checks` runs the public giftcomm.reduce_scatter, allgather, allreduce (ring
and direct) and gift_allreduce with a low-rank KFAC geometry over the device loopback, with
arrays of backend ``xp`` (CuPy on a GPU machine: perf/device_check.sh; NumPy in the CPU tests,
which run this very code), and compares every rank's result with giftcomm.reference bit for bit.

Geometries: on the GPU the transforms' GEMMs may round differently from NumPy's, so the exact
comparison is with the simulation of the same steps using the same backend's transforms
(:class:`OnBackend`), and the CPU simulation is only required to be close.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from giftcomm.reference import simulate_allgather, simulate_allreduce, simulate_gift_allreduce, simulate_reduce_scatter
from giftcomm.transport.device_loopback import DeviceLoopbackGroup
from studies.device.edge_cases import random_vector

__all__ = ["KFAC_LAYOUT", "random_kfac_geometry", "OnBackend", "collective_checks"]

KFAC_LAYOUT = [("w1", (40, 32)), ("b1", (40,)), ("w2", (24, 40))]


def random_kfac_geometry(rng: np.random.Generator, rank: int | None = None, layout=None) -> Any:
    """A KFAC geometry (low rank when ``rank`` is given) from random SPD factors with condition
    number 1e3, for every 2-D segment of ``layout`` (default :data:`KFAC_LAYOUT`)."""
    from giftcomm.geometry import Geometry

    def spd(n: int) -> np.ndarray:
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        return (q * np.geomspace(1, 1e-3, n)) @ q.T

    layout = KFAC_LAYOUT if layout is None else layout
    factors = {name: (spd(shape[1]), spd(shape[0])) for name, shape in layout if len(shape) == 2}
    return Geometry.from_kfac(layout, factors, rank=rank)


class OnBackend:
    """A geometry whose forward/inverse run on backend ``xp`` and hand NumPy back: what the
    simulation needs to reproduce the device path's transforms bit for bit."""

    def __init__(self, geometry: Any, xp: Any, to_host: Callable[[Any], np.ndarray]) -> None:
        self.geometry, self.xp, self.to_host = geometry, xp, to_host
        self.size, self.is_identity = geometry.size, geometry.is_identity

    def forward(self, flat: np.ndarray) -> np.ndarray:
        return self.to_host(self.geometry.forward(self.xp.asarray(np.asarray(flat, np.float32))))

    def inverse(self, flat: np.ndarray) -> np.ndarray:
        return self.to_host(self.geometry.inverse(self.xp.asarray(np.asarray(flat, np.float32))))

    def fingerprint(self) -> int:
        return self.geometry.fingerprint()


def _bitwise(got: list, want: list) -> bool:
    return all(g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes() for g, w in zip(got, want))


def collective_checks(xp: Any, to_host: Callable[[Any], np.ndarray], quick: bool = False,
                      seed: int = 11) -> list[tuple[str, bool, float]]:
    """Run every check; returns (label, passed, seconds) per check. ``xp``: numpy or cupy;
    ``to_host``: device array -> NumPy. ``quick``: smaller sizes and rank counts."""
    import giftcomm

    rng = np.random.default_rng(seed)
    big = 65_537 if quick else 1_000_003
    results: list[tuple[str, bool, float]] = []

    def check(label: str, p: int, body: Callable[[Any, int], Any], want: list) -> None:
        t0 = time.time()
        got = DeviceLoopbackGroup(p).run(lambda t: body(t, t.rank))
        results.append((label, _bitwise([to_host(g) for g in got], want), time.time() - t0))

    for p in ((3,) if quick else (4, 8)):
        for algorithm in ("ring", "direct"):
            for n, block, dtype, op in ((big, 256, np.float32, "sum"), (4097, 32, np.float16, "avg"), (7, 3, np.float64, "avg")):
                xs = [random_vector(rng, n, 8).astype(dtype) for _ in range(p)]
                dev = [xp.asarray(x) for x in xs]
                check(f"reduce_scatter P={p} {algorithm} n={n} block={block} {np.dtype(dtype).name} {op}", p,
                      lambda t, r: giftcomm.reduce_scatter(dev[r], comm=t, op=op, fmt="e4m3", block=block,
                                                           algorithm=algorithm),
                      simulate_reduce_scatter(xs, "e4m3", block, op, algorithm))
                if op == "sum":
                    check(f"allgather(reduce_scatter) == allreduce P={p} {algorithm} n={n}", p,
                          lambda t, r: giftcomm.allgather(
                              giftcomm.reduce_scatter(dev[r], comm=t, op="sum", fmt="e4m3", block=block,
                                                      algorithm=algorithm),
                              comm=t, fmt="e4m3", block=block),
                          simulate_allreduce(xs, "e4m3", block, "sum", algorithm))
        shards = [random_vector(rng, int(rng.integers(0, 5000)), 8) for _ in range(p)]
        shards[-1] = shards[-1][:0]
        dev_shards = [xp.asarray(s) for s in shards]
        check(f"allgather P={p} shard lengths {[s.size for s in shards]}", p,
              lambda t, r: giftcomm.allgather(dev_shards[r], comm=t, fmt="e5m2", block=32), simulate_allgather(shards, "e5m2", 32))
        for fmt in ("e4m3", "e5m2", "bf16"):
            xs = [random_vector(rng, big, 8) for _ in range(p)]
            dev = [xp.asarray(x) for x in xs]
            check(f"allreduce direct P={p} {fmt} n={big} avg", p,
                  lambda t, r: giftcomm.allreduce(dev[r], comm=t, op="avg", fmt=fmt, block=256, algorithm="direct"),
                  simulate_allreduce(xs, fmt, 256, "avg", "direct"))
        geo = random_kfac_geometry(rng, rank=8)
        xs = [rng.standard_normal(geo.size).astype(np.float32) for _ in range(p)]
        dev = [xp.asarray(x) for x in xs]
        for algorithm in ("ring", "direct"):
            label = f"gift_allreduce low-rank KFAC geometry P={p} {algorithm} avg"
            check(label, p, lambda t, r: giftcomm.gift_allreduce(dev[r], geo, comm=t, op="avg", fmt="e4m3", block=64,
                                                                algorithm=algorithm),
                  simulate_gift_allreduce(xs, OnBackend(geo, xp, to_host), "e4m3", 64, "avg", algorithm))
            got = to_host(DeviceLoopbackGroup(p).run(
                lambda t: giftcomm.gift_allreduce(dev[t.rank], geo, comm=t, op="avg", fmt="e4m3", block=64,
                                                  algorithm=algorithm))[0])
            cpu = simulate_gift_allreduce(xs, geo, "e4m3", 64, "avg", algorithm)[0]
            err = float(np.linalg.norm(got - cpu) / np.linalg.norm(cpu))
            results.append((f"{label}: relative distance to the CPU simulation {err:.1e} (<= 2e-2)", err <= 2e-2, 0.0))
    return results
