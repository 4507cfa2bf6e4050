"""One process of the two-process check of giftcomm.adapters.jax's jit path (jax.distributed, CPU).

``python tests/jax_dist_case.py PORT PROCESS_ID`` joins a 2-process ``jax.distributed`` group
(coordinator 127.0.0.1:PORT; CPU collectives over gloo), each process with 2 host devices, and
runs psum / pmean over the 4-device mesh (ring and direct, e4m3 stochastic and nvfp4). Every
device's per-device input is generated from one seed, so each process computes the reference
(simulate_allreduce of all 4 inputs) itself; it prints one JSON line {case: [ok, detail]} for the
devices it holds. tests/test_jax_jit.py starts the two processes.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from giftcomm.adapters import jax as gj  # noqa: E402
from giftcomm.reference.simulate import simulate_allreduce  # noqa: E402


def main() -> None:
    port, pid = int(sys.argv[1]), int(sys.argv[2])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid, initialization_timeout=120)
    devices = jax.devices()
    assert len(devices) == 4 and jax.process_count() == 2, (len(devices), jax.process_count())
    mesh = jax.make_mesh((4,), ("data",), devices=devices)
    n = 3 * 256 + 41
    xs = np.random.default_rng(20261205).standard_normal((4, n)).astype(np.float32)
    sharding = NamedSharding(mesh, P("data"))
    arr = jax.make_array_from_callback(xs.shape, sharding, lambda idx: xs[idx])
    plan = [("psum", dict(fmt="e4m3", rounding="stochastic", seed=17)), ("pmean", dict(fmt="nvfp4", algorithm="direct"))]

    def body(v):
        return [getattr(gj, fn)(v[0], "data", **o)[None] for fn, o in plan]

    outs = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(arr)
    results = {}
    for (fn, o), out in zip(plan, outs):
        kw = {k: v for k, v in o.items() if k not in ("fmt", "algorithm")}
        want = simulate_allreduce(list(xs), o["fmt"], None, "avg" if fn == "pmean" else "sum",
                                  o.get("algorithm", "ring"), **kw)[0]
        shards = out.addressable_shards
        ok = len(shards) == 2 and all(np.asarray(s.data)[0].tobytes() == want.tobytes() for s in shards)
        results[f"dist/process{pid}/{fn}/{o['fmt']}"] = [bool(ok), f"{len(shards)} local shards"]
    print(json.dumps(results), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
