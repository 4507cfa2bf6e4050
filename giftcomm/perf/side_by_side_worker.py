"""One measurement of ``python -m giftcomm.perf side-by-side`` (giftcomm.perf.side_by_side), run
by path under mpiexec with PYTHONPATH set to the tree being measured::

    PYTHONPATH=<tree> mpiexec -n P python <this file> '<json parameters>'

It imports the giftcomm found on PYTHONPATH and uses only its public API (``giftcomm.allreduce``;
for the ``ddp`` kind ``giftcomm.adapters.torch.GiftState`` and ``gift_hook``), so an older tree
needs no new code. The timing is this file's sibling giftcomm/perf/timing.py, loaded by path (it
imports nothing from giftcomm): the same helper for every tree.

Parameters (JSON object): ``kind`` ("allreduce" or "ddp"); ``contenders``: a list of
``{"label": str, "call": {keywords} | null}`` (allreduce: the keywords of ``giftcomm.allreduce``,
null for MPI_Allreduce on float32; ddp: the keywords of ``GiftState``, null for DDP's default
hook); ``rounds`` (interleaved rounds of :func:`timing.time_rounds`), ``warmup``; allreduce:
``sizes`` (bytes of float32 input) and ``calls`` (back-to-back calls per timing; 0: by size);
ddp: ``width``, ``depth``, ``batch``, ``steps`` (steps per timing), ``rendezvous`` (a file path).

Rank 0 prints one line ``SIDE-BY-SIDE {json}``: ``{"rows": {row: {label: seconds per call, or
null where it did not run}}, "notes": {label: why it did not run}, "ran": {row: the algorithm
the first contender ran, where the tree reports it}}``. A contender whose first (untimed) call
raises on any rank is left out on every rank (the ranks agree) and named in ``notes``.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any


def _timing() -> Any:
    """giftcomm/perf/timing.py beside this file, loaded by path (not from the tree measured)."""
    spec = importlib.util.spec_from_file_location("_side_by_side_timing", Path(__file__).with_name("timing.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _agreed_probe(fns: dict[str, Any], comm: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """Call each function once; keep those that ran on every rank (the ranks agree by a MIN
    allreduce), with the first rank-local error message of the others."""
    from mpi4py import MPI

    kept, notes = {}, {}
    for label, fn in fns.items():
        try:
            fn()
            err = ""
        except Exception as exc:  # noqa: BLE001 - reported, and every rank leaves it out alike
            err = f"{type(exc).__name__}: {exc}"
        if comm.allreduce(0 if err else 1, op=MPI.MIN):
            kept[label] = fn
        else:
            notes[label] = err or "failed on another rank"
    return kept, notes


def _allreduce(params: dict[str, Any], timing: Any) -> dict[str, Any]:
    import numpy as np
    from mpi4py import MPI

    import giftcomm

    comm = MPI.COMM_WORLD
    rows: dict[str, dict[str, float | None]] = {}
    notes: dict[str, str] = {}
    ran: dict[str, str] = {}
    for nbytes in params["sizes"]:
        x = np.random.default_rng(comm.rank).standard_normal(max(nbytes // 4, 1)).astype(np.float32)
        out, y = np.empty_like(x), np.empty_like(x)

        def make(call: dict[str, Any] | None) -> Any:
            if call is None:
                return lambda: comm.Allreduce(x, y, op=MPI.SUM)
            return lambda: giftcomm.allreduce(x, out=out, **call)

        fns, why = _agreed_probe({c["label"]: make(c["call"]) for c in params["contenders"]}, comm)
        notes.update(why)
        calls = params["calls"] or max(1, min(50, (1 << 22) // max(nbytes, 1)))
        times = timing.time_rounds(list(fns.values()), params["rounds"], calls=calls, warmup=params["warmup"],
                                   comm=comm)
        got = dict(zip(fns, times))
        rows[str(nbytes)] = {c["label"]: got.get(c["label"]) for c in params["contenders"]}
        first = params["contenders"][0]
        if first["label"] in fns:
            fns[first["label"]]()
            try:
                from giftcomm.api import last_algorithm
                last = last_algorithm(comm)
                if last:
                    ran[str(nbytes)] = str(last[0])
            except ImportError:
                pass
    return {"rows": rows, "notes": notes, "ran": ran}


def _ddp(params: dict[str, Any], timing: Any) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    from giftcomm.adapters.torch import GiftState, gift_hook

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    if comm.rank == 0 and os.path.exists(params["rendezvous"]):
        os.remove(params["rendezvous"])  # a stale store of an earlier run
    comm.Barrier()
    dist.init_process_group("gloo", init_method=f"file://{params['rendezvous']}", rank=comm.rank,
                            world_size=comm.size)
    width, depth, batch = params["width"], params["depth"], params["batch"]
    states: list[Any] = []

    def make(call: dict[str, Any] | None) -> Any:
        """One step of its own DDP copy of the same MLP (depth x Linear(width) + GELU, then Linear(width, 16)), SGD."""
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        ddp = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(width, 16)), gradient_as_bucket_view=True)
        if call is not None:
            state = GiftState(**call)
            states.append(state)
            ddp.register_comm_hook(state, gift_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1000 + comm.rank)

        def step() -> None:
            loss = ddp(torch.randn(batch, width, generator=gen)).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
        return step

    try:
        fns, notes = _agreed_probe({c["label"]: make(c["call"]) for c in params["contenders"]}, comm)
        times = timing.time_rounds(list(fns.values()), params["rounds"], calls=params["steps"],
                                   warmup=params["warmup"], comm=comm)
    finally:
        for state in states:
            state.shutdown()
    got = dict(zip(fns, times))
    dist.barrier()
    dist.destroy_process_group()
    return {"rows": {"step": {c["label"]: got.get(c["label"]) for c in params["contenders"]}}, "notes": notes,
            "ran": {}}


KINDS = {"allreduce": _allreduce, "ddp": _ddp}


def main(argv: list[str]) -> None:
    here = Path(__file__).resolve().parent  # Python put it first on sys.path: its modules are not top-level ones
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    params = json.loads(argv[0])
    result = KINDS[params["kind"]](params, _timing())
    from mpi4py import MPI

    if MPI.COMM_WORLD.rank == 0:
        print("SIDE-BY-SIDE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
