"""giftcomm.adapters.jax.psum inside jit against lax.psum, measured in the same run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python perf/jax_jit_bench.py
    python perf/jax_jit_bench.py --sizes 64K,1M --fmts e4m3,nvfp4 --algorithms ring,direct

For each size (float32 values per device) and each giftcomm variant: one ``jax.jit`` over
``jax.shard_map`` on a 1-D mesh of every device jax sees (on CPU the script asks XLA for
``--devices`` host devices unless XLA_FLAGS already sets a count), reducing a float32 vector with
``lax.psum`` (the baseline) or ``giftcomm.adapters.jax.psum``. Rounds alternate the baseline and
the variants; each round times ``--reps`` back-to-back calls (``block_until_ready``) after a
warm-up; the table shows the median per-call time over ``--rounds`` rounds and its ratio to
lax.psum's (> 1: giftcomm slower), and the bytes one device sends and their ratio:

- giftcomm: measured from the compiled program (the uint8 operands of its collective-permutes,
  each sent once, and of its all-gather, whose message goes to P - 1 devices); it equals
  ``jax_jit.wire_bytes``;
- lax.psum: a ring all-reduce's ``2 (P - 1) / P * 4 n`` (NCCL's ring on GPUs; XLA:CPU's own
  all-reduce moves memory within one process, so there is no wire to count).

On CPU host devices the "collectives" are memory copies inside one process: the time ratio
measures the codec's compute against a memcpy-speed all-reduce, not a network. What a GPU run
must measure: the same table on 8 GPUs of one node (NVLink) and on 2+ nodes (InfiniBand /
Ethernet), the per-call time of psum at 1M-64M values per device against lax.psum (NCCL), the
time of the encode/decode kernels alone (a profile of the step: XLA's fused element-wise ops vs
the collective-permutes), and that the results still equal the reference bit for bit there
(the codec relies on float32 products not being contracted into FMAs: tests/jax_jit_cases.py's
codec cases run on the GPU unchanged).
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import time


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="giftcomm's jit psum vs lax.psum (time and bytes per device)")
    ap.add_argument("--sizes", default="64K,1M", help="float32 values per device, comma separated (K, M suffixes)")
    ap.add_argument("--fmts", default="e4m3,nvfp4")
    ap.add_argument("--algorithms", default="ring,direct")
    ap.add_argument("--devices", type=int, default=8, help="CPU host devices to ask XLA for (ignored off CPU)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="calls timed back to back per round")
    return ap.parse_args(argv)


_WIDTH = {"u8": 1, "s8": 1, "bf16": 2, "f16": 2, "f32": 4, "u32": 4, "s32": 4}


def _count(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def _sent_bytes(hlo: str, p: int) -> int:
    """Bytes one device sends in a compiled program: each collective-permute's operand once, each
    all-gather's operand to P - 1 devices. Synchronous ops (``= u8[..] collective-permute(``: the
    result, the operand's shape; an all-gather's result is P operands) and asynchronous starts
    (``= (operand, result, ...) ...-start(``, GPUs) both count."""
    total = 0
    for dtype, dims, op in re.findall(r"= (\w+)\[([\d,]*)\]\S* (collective-permute|all-gather)\(", hlo):
        n = _count(dims) * _WIDTH[dtype]
        total += n if op == "collective-permute" else n // p * (p - 1)
    for dtype, dims, op in re.findall(r"= \((\w+)\[([\d,]*)\]\S*, [^)]*\) (collective-permute|all-gather)-start\(", hlo):
        n = _count(dims) * _WIDTH[dtype]
        total += n if op == "collective-permute" else n * (p - 1)
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
            f" --xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from giftcomm.adapters import jax as gj
    from giftcomm.adapters.jax.jit import wire_bytes

    devices = jax.devices()
    p = len(devices)
    mesh = jax.make_mesh((p,), ("d",), devices=devices)
    shard = NamedSharding(mesh, P("d"))
    variants = [(f, a) for f in args.fmts.split(",") for a in args.algorithms.split(",")]
    print(f"# jax {jax.__version__}, {p} {devices[0].platform} devices ({devices[0].device_kind}), "
          f"{args.rounds} rounds x {args.reps} calls, median per call; command: {' '.join(sys.argv)}")
    print(f"{'values/dev':>10} {'variant':>14} {'ms/call':>10} {'x lax.psum':>10} {'bytes/dev':>12} {'x lax.psum':>10}")
    for n in map(_size, args.sizes.split(",")):
        x = jax.device_put(np.random.default_rng(0).standard_normal(p * n).astype(np.float32), shard)

        def program(reduce):
            return jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

        fns = {"lax.psum": program(lambda v: jax.lax.psum(v, "d"))}
        for fmt, alg in variants:
            fns[f"{fmt}/{alg}"] = program(functools.partial(lambda v, f, a: gj.psum(v, "d", fmt=f, algorithm=a),
                                                            f=fmt, a=alg))
        sent = {"lax.psum": 2 * (p - 1) * 4 * n // p}
        for name, fn in fns.items():
            if name != "lax.psum":
                sent[name] = _sent_bytes(fn.lower(x).compile().as_text(), p)
                fmt, alg = name.split("/")
                if alg == "ring":
                    assert sent[name] == wire_bytes(n, p, fmt=fmt), (name, sent[name], wire_bytes(n, p, fmt=fmt))
            jax.block_until_ready(fn(x))  # compile and warm up
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    out = fn(x)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / args.reps)
        base = statistics.median(times["lax.psum"])
        for name in fns:
            t = statistics.median(times[name])
            print(f"{n:>10} {name:>14} {t * 1e3:>10.3f} {t / base:>10.2f} {sent[name]:>12} "
                  f"{sent[name] / sent['lax.psum']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
