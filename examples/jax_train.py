"""JAX data parallelism with giftcomm: the split train step (the adapter runs outside jax.jit).

    mpiexec -n 2 python examples/jax_train.py --quick
    python examples/jax_train.py --quick          # one process: MPI's world of 1

``grads = grad_fn(params, batch)`` (jitted) -> ``allreduce_tree``/``TreeSync`` (giftcomm, outside
jit; GPU arrays go through the device path) -> ``params = update(params, grads)`` (jitted).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from giftcomm import GiftSchedule
from giftcomm.adapters.jax import TreeSync
from giftcomm.geometry import SelectivePolicy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--hidden", type=int, default=512, help="hidden width (w1 is 16 x hidden)")
    args = p.parse_args()
    if args.quick:
        args.steps = 10
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    dtype = getattr(jnp, args.dtype)
    key = jax.random.PRNGKey(0)  # same initial parameters on every rank
    k1, k2 = jax.random.split(key)
    h = args.hidden
    params = {"w1": (jax.random.normal(k1, (16, h)) * 0.2).astype(dtype), "b1": jnp.zeros(h, dtype),
              "w2": (jax.random.normal(k2, (h, 1)) * (0.2 / np.sqrt(h / 64))).astype(dtype)}
    w_true = np.random.default_rng(7).standard_normal((16, 1)).astype(np.float32)
    data = np.random.default_rng(100 + rank)

    def loss_fn(q, x, y):
        h = jnp.tanh(x @ q["w1"].astype(jnp.float32) + q["b1"].astype(jnp.float32))
        return jnp.mean((h @ q["w2"].astype(jnp.float32) - y) ** 2)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))

    @jax.jit
    def update(q, g):
        return jax.tree_util.tree_map(lambda a, b: (a.astype(jnp.float32) - 0.05 * b.astype(jnp.float32)).astype(a.dtype),
                                      q, g)

    # The per-segment rule (budget=None): this model's collective is so small that the default
    # budget (a tenth of its predicted wire time) leaves no room for any transform.
    sync = TreeSync(comm=comm, fmt="e4m3", schedule=GiftSchedule(geometry="reduced", refresh_every=5,
                    estimate_every=1, policy=SelectivePolicy(budget=None)))
    for step in range(args.steps):
        x = data.standard_normal((32, 16)).astype(np.float32)
        loss, grads = grad_fn(params, x, x @ w_true)      # jitted
        grads = sync(grads)                               # giftcomm, outside jit
        params = update(params, grads)                    # jitted
        if rank == 0 and (step % max(1, args.steps // 5) == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {float(loss):.4f}", flush=True)
    digest = comm.allgather(float(sum(float(jnp.sum(v.astype(jnp.float32))) for v in params.values())))
    transformed = 0 if sync.geometry is None else sum(not t.is_identity for t in sync.geometry.transforms)
    if rank == 0:
        print(f"{comm.Get_size()} ranks: {transformed} transformed segments; parameters identical on every rank: "
              f"{len(set(digest)) == 1}", flush=True)


if __name__ == "__main__":
    main()
