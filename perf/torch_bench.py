"""What perf/fsdp_step.py and perf/ddp_step.py share: the launch, the model, and where giftcomm's
host time goes inside a torch.distributed training step (a diagnostic).

    import torch_bench                       # from a script in perf/ (its directory is on sys.path)
    torch_bench.init_process_group(args.rendezvous, "gloo")
    model = torch_bench.linear_stack(2048, 4)
    torch_bench.install()                    # wrap the codec kernels and the gloo transport's calls
    torch_bench.reset(); ...; ms = torch_bench.milliseconds()

:func:`install` wraps, with a perf_counter timer each: the codec kernels giftcomm's collectives call
(giftcomm.codec's native and reference tables: encode, decode, decode_add_encode,
decode_accumulate, summed as "codec"), the waits on TorchDistTransport's gloo sends and receives
("wait": time the collective sat waiting for the network or a peer), posting them ("post"), and
its int64 allgather (the call's agreement, "agree"). Only giftcomm's calls pass through these, so
FSDP's and DDP's own collectives are not counted. The timers add about a microsecond per call.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

_spent: collections.defaultdict[str, float] = collections.defaultdict(float)
_lock = threading.Lock()
_installed = False


def _wrap(owner: Any, name: str, key: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                _spent[key] += dt

    if isinstance(owner.__dict__.get(name), staticmethod):
        setattr(owner, name, staticmethod(wrapper))
    else:
        setattr(owner, name, wrapper)


def install() -> None:
    """Wrap the kernels and transport calls (once per process)."""
    global _installed
    if _installed:
        return
    from giftcomm import codec
    from giftcomm.transport import torch_dist

    for kernels in (codec.NativeKernels, codec.ReferenceKernels):
        for name in ("encode", "decode", "decode_add_encode", "decode_accumulate"):
            _wrap(kernels, name, "codec")
    _wrap(torch_dist._TorchRequest, "wait", "wait")
    for name in ("isend", "irecv"):
        _wrap(torch_dist.TorchDistTransport, name, "post")
    _wrap(torch_dist.TorchDistTransport, "allgather_int64", "agree")
    _installed = True


def reset() -> None:
    with _lock:
        _spent.clear()


def milliseconds() -> dict[str, float]:
    """Milliseconds in each part since the last :func:`reset`."""
    with _lock:
        return {k: 1e3 * _spent.get(k, 0.0) for k in ("codec", "wait", "post", "agree")}


def step_arguments(ap: argparse.ArgumentParser, steps: int, rounds: int) -> None:
    """The arguments every perf/*_step.py takes: ``--steps`` (timed steps per configuration and
    round), ``--rounds`` (the configurations interleaved round by round) and ``--rendezvous``
    (:func:`init_process_group`'s)."""
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per configuration and round")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--rendezvous", default=None,
                    help="under mpiexec: a file path every rank can see (rank and size from MPI)")


def output_arguments(ap: argparse.ArgumentParser, fmts: str = "e4m3") -> None:
    """The arguments of every perf/*_step.py's results: ``--fmts`` (giftcomm's wire formats, one
    configuration each) and ``--json OUT`` (:func:`write_rows`)."""
    ap.add_argument("--fmts", default=fmts, help="giftcomm's wire formats, comma-separated (a configuration each)")
    ap.add_argument("--json", metavar="OUT", default=None,
                    help="write the rows (mode, group, step_ms, bytes_per_step, overhead_ms) as JSON")


def overheads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (each with "mode", "group", "step_ms", "bytes_per_step") with each row's
    communication overhead added: ``overhead_ms`` = its step_ms minus the "compute-only" row's of
    the same mode (the same forward, backward and update with no gradient communication), and
    ``overhead_vs_gloo`` = that over the "gloo" row's overhead (the trainer's uncompressed group),
    None where the denominator is not positive."""
    compute = {r["mode"]: r["step_ms"] for r in rows if r["group"] == "compute-only"}
    out = [dict(r, overhead_ms=r["step_ms"] - compute[r["mode"]]) for r in rows]
    gloo = {r["mode"]: r["overhead_ms"] for r in out if r["group"] == "gloo"}
    for r in out:
        base = gloo.get(r["mode"])
        r["overhead_vs_gloo"] = r["overhead_ms"] / base if base is not None and base > 0 else None
    return out


def write_rows(path: str | None, benchmark: str, rows: list[dict[str, Any]], **meta: Any) -> list[dict[str, Any]]:
    """The rows with their overheads (:func:`overheads`); written, when ``path`` is given, as
    ``{"benchmark": ..., "command": argv, **meta, "rows": [...]}`` (call on rank 0 only)."""
    rows = overheads(rows)
    if path:
        with open(path, "w") as f:
            json.dump({"benchmark": benchmark, "command": sys.argv, **meta, "rows": rows}, f, indent=1)
            f.write("\n")
    return rows


def print_overheads(rows: list[dict[str, Any]]) -> None:
    """One line per row: step, communication overhead (step minus compute-only) and its ratio to
    the uncompressed group's, bytes per step."""
    print(f"{'mode':<10} {'group':<16} {'step ms':>9} {'overhead ms':>12} {'vs gloo':>8} {'MB/step':>9}")
    for r in rows:
        ratio = "-" if r["overhead_vs_gloo"] is None else f"{r['overhead_vs_gloo']:.2f}x"
        print(f"{r['mode']:<10} {r['group']:<16} {r['step_ms']:>9.1f} {r['overhead_ms']:>12.1f} {ratio:>8} "
              f"{r['bytes_per_step'] / 1e6:>9.2f}")


class LocalReduceScatter:
    """An FSDP2 reduce-scatter comm (``FSDPModule.set_custom_reduce_scatter``) that communicates
    nothing: each rank keeps its own row of the flat input, ``input.view(P, -1)[rank]`` (the
    compute-only step's stand-in for the gradient reduce-scatter; the values are not a sum)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        output_tensor.copy_(input_tensor.reshape(world, -1)[rank].view_as(output_tensor))


def init_process_group(rendezvous: str | None, backend: str = "gloo") -> None:
    """torch.distributed's default group: from torchrun's environment, or (``rendezvous``: a file
    path every rank can see) with rank and size from MPI, for jobs that mpiexec launches (the
    netbed, docs/netbed.md)."""
    if not rendezvous:
        dist.init_process_group(backend)
        return
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.rank == 0 and os.path.exists(rendezvous):
        os.remove(rendezvous)  # a stale store from an earlier run
    comm.Barrier()
    dist.init_process_group(backend, init_method=f"file://{os.path.abspath(rendezvous)}", rank=comm.rank,
                            world_size=comm.size)


def linear_stack(width: int, layers: int) -> torch.nn.Sequential:
    """``layers`` bias-free nn.Linear(width, width), tanh after each (seeded: the same weights in
    every configuration and on every rank); width 2048 and 4 layers hold 16.8M parameters, 64 MiB
    of float32 gradients, 16 MiB per layer."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def ratio(a: float, b: float) -> str:
    """``a / b`` as "2.00x", or "-" when ``b`` is 0 (one rank: nothing was communicated)."""
    return f"{a / b:.2f}x" if b > 0 else "-"


def agreement_per_rank(phases: list[dict[str, float]]) -> str:
    """Every rank's median agreement milliseconds per step (``phases[1:]``: after the warm-up
    step), as "r0 / r1 / ..." (collective over the default group). The agreement is where a call
    waits for its peers to arrive, so a rank that arrives last shows little of it."""
    mine = statistics.median(p["agree"] for p in phases[1:]) if len(phases) > 1 else 0.0
    every: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return " / ".join(f"{ms:.1f}" for ms in every)
