"""giftcomm.adapters.jax.psum / pmean inside jit against lax.psum / pmean across processes
(``jax.distributed``, CPU collectives over gloo), measured in the same run: the jit path on a network.

    mpiexec -n 2 python perf/jax_dist_bench.py --sizes 1M --fmts e4m3,nvfp4
    # on the netbed (docs/netbed.md): one process per host, the links rate-shaped
    perf/netbed run --hosts 4 --rate 1gbit --keep-env -- env GLOO_SOCKET_IFNAME=eth0 \
        python perf/jax_dist_bench.py --sizes 1M,4M --json OUT

mpiexec only starts the processes and tells each its rank: rank 0's address (its ``eth0`` on the
netbed, 127.0.0.1 elsewhere) becomes ``jax.distributed``'s coordinator, every process holds one
CPU device, and the collectives run inside the compiled programs (XLA:CPU's collectives over gloo
TCP, across the processes). For each size (float32 values per process) the baseline
(``lax.psum``, or ``lax.pmean`` with ``--op mean``) and each giftcomm variant (``--fmts`` x
``--algorithms``) are one ``jax.jit`` over ``jax.shard_map`` on the 1-D mesh of all processes;
rounds alternate them, each round times ``--reps`` back-to-back calls after a warm-up, and rank 0
prints the median per-call time (the slowest process's, through an MPI max), its ratio to the
baseline, and the bytes a process sends (giftcomm: counted from the compiled program's
collective-permutes and all-gather, as perf/jax_jit_bench.py counts them; the baseline: a ring
all-reduce's ``2 (P - 1) / P * 4 n``). Every giftcomm result is checked against
``giftcomm.simulate_allreduce`` of all the processes' inputs, bit for bit.
"""
from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax_jit_bench import _sent_bytes, _size  # noqa: E402  (perf/jax_jit_bench.py)


def _address(interface: str = "eth0") -> str:
    """This host's IPv4 address on ``interface`` (SIOCGIFADDR), or 127.0.0.1 without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M", help="float32 values per process, comma separated (K, M suffixes)")
    ap.add_argument("--fmts", default="e4m3,nvfp4")
    ap.add_argument("--algorithms", default="ring,direct")
    ap.add_argument("--op", choices=["sum", "mean"], default="sum", help="psum (default) or pmean")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3, help="calls timed back to back per round")
    ap.add_argument("--port", type=int, default=47613, help="the coordinator's port on rank 0 (0: a free one)")
    ap.add_argument("--json", metavar="OUT", default=None, help="rank 0 writes the rows as JSON")
    return ap.parse_args(argv)


def _gloo_on_interface(name: str) -> None:
    """Bind XLA:CPU's gloo collectives to the interface ``name`` (torch's GLOO_SOCKET_IFNAME).
    Without one gloo binds to the address of the host's name, which the netbed's hosts cannot
    resolve ("enforce fail at gloo/transport/tcp/device.cc"); jaxlib's factory takes an interface
    but jax does not pass one, so the factory jax calls gets it bound here."""
    from jax._src.lib import _jax

    _jax.make_gloo_tcp_collectives = functools.partial(_jax.make_gloo_tcp_collectives, interface=name)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    coordinator = comm.bcast(f"{_address()}:{args.port or _free_port()}" if rank == 0 else None, root=0)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        _gloo_on_interface(os.environ["GLOO_SOCKET_IFNAME"])
    jax.distributed.initialize(coordinator, num_processes=size, process_id=rank,
                               initialization_timeout=120)
    from giftcomm.adapters import jax as gj
    from giftcomm.reference.simulate import simulate_allreduce

    devices = jax.devices()
    p = len(devices)
    mesh = jax.make_mesh((p,), ("d",), devices=devices)
    shard = NamedSharding(mesh, P("d"))
    base_name = f"lax.p{args.op}"
    variants = [(f, a) for f in args.fmts.split(",") for a in args.algorithms.split(",")]
    rows = []
    if rank == 0:
        print(f"# jax {jax.__version__}, {p} processes x 1 {devices[0].platform} device, coordinator {coordinator}, "
              f"link {os.environ.get('GIFTCOMM_NETBED_RATE', 'local')}; {args.rounds} rounds x {args.reps} calls, "
              f"median per call (slowest process); command: {' '.join(sys.argv)}", flush=True)
        print(f"{'values/dev':>10} {'variant':>14} {'ms/call':>10} {'x ' + base_name:>11} {'bytes/dev':>12} "
              f"{'x ' + base_name:>11} {'bit-exact':>9}", flush=True)
    for n in map(_size, args.sizes.split(",")):
        xs = np.random.default_rng(n).standard_normal((p, n)).astype(np.float32)  # every process's input
        x = jax.make_array_from_callback((p * n,), shard, lambda idx: xs.reshape(-1)[idx])

        def program(reduce):
            return jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

        lax_reduce = jax.lax.psum if args.op == "sum" else jax.lax.pmean
        gift_reduce = gj.psum if args.op == "sum" else gj.pmean
        fns = {base_name: program(lambda v: lax_reduce(v, "d"))}
        for fmt, alg in variants:
            fns[f"{fmt}/{alg}"] = program(functools.partial(lambda v, f, a: gift_reduce(v, "d", fmt=f, algorithm=a),
                                                            f=fmt, a=alg))
        sent = {base_name: 2 * (p - 1) * 4 * n // p}
        exact = {base_name: "-"}
        for name, fn in fns.items():
            out = jax.block_until_ready(fn(x))  # compile and warm up
            if name == base_name:
                continue
            sent[name] = _sent_bytes(fn.lower(x).compile().as_text(), p)
            fmt, alg = name.split("/")
            want = simulate_allreduce(list(xs), fmt, None, "sum" if args.op == "sum" else "avg", alg)[0]
            mine = np.asarray(out.addressable_shards[0].data)
            ok = comm.allreduce(bool(np.array_equal(mine.view(np.uint32), want.view(np.uint32))), op=MPI.LAND)
            exact[name] = "yes" if ok else "NO"
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    out = fn(x)
                jax.block_until_ready(out)
                times[name].append(comm.allreduce((time.perf_counter() - t0) / args.reps, op=MPI.MAX))
        base = statistics.median(times[base_name])
        for name in fns:
            t = statistics.median(times[name])
            row = dict(values=n, variant=name, ms_per_call=1e3 * t, time_vs_base=t / base, bytes_per_device=sent[name],
                       bytes_vs_base=sent[name] / sent[base_name], bit_exact=exact[name])
            rows.append(row)
            if rank == 0:
                print(f"{n:>10} {name:>14} {t * 1e3:>10.3f} {t / base:>11.2f} {sent[name]:>12} "
                      f"{sent[name] / sent[base_name]:>11.3f} {exact[name]:>9}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "jax_dist_bench", "command": sys.argv, "processes": p, "op": args.op,
                       "link": os.environ.get("GIFTCOMM_NETBED_RATE", "local"), "rows": rows}, f, indent=1)
            f.write("\n")
    bad = [r["variant"] for r in rows if r["bit_exact"] == "NO"]
    jax.distributed.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
