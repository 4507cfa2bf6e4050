"""Flax + Optax data-parallel training with giftcomm's quantized pmean inside the jitted step.

    python examples/jax_jit_train.py                      # 8 CPU host devices, e4m3, 200 steps
    python examples/jax_jit_train.py --fmt nvfp4 --rounding stochastic --feedback

A small Flax (linen) MLP learns a fixed random teacher network's outputs (regression, mean
squared error) with Adam. The train step is one ``jax.jit`` over ``jax.shard_map`` on a 1-D
"data" mesh: every device computes the gradients of its slice of the global batch, and the
gradients are averaged with ``giftcomm.adapters.jax.pmean`` where the usual step has
``lax.pmean``. The script trains twice from the same initialisation and data -- once with
``lax.pmean``, once with giftcomm's -- and prints both final losses (the mean over the last 20
steps) and their relative difference; it exits 1 when that exceeds ``--tolerance`` (default
0.10: the quantized run's final loss within 10% of the full-precision run's; e4m3 measures well
inside it). With ``--rounding stochastic`` the step number is the (traced) seed of each step's
rounding, the same on every device; ``--feedback`` carries the error-feedback state
(``feedback_init``) through the steps functionally.

Runs unchanged on GPUs (``--devices 0`` uses every device jax sees; on CPU the script asks XLA
for ``--devices`` host devices, 8 by default).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--devices", type=int, default=8, help="CPU host devices to ask XLA for (0: every device seen)")
    ap.add_argument("--batch", type=int, default=256, help="global batch (divided over the devices)")
    ap.add_argument("--fmt", default="e4m3")
    ap.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"))
    ap.add_argument("--feedback", action="store_true", help="error feedback carried through the steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.devices > 0 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from giftcomm.adapters import jax as gj

    devices = jax.devices() if args.devices == 0 else jax.devices()[: args.devices]
    p = len(devices)
    mesh = jax.make_mesh((p,), ("data",), devices=devices)
    if args.batch % p:
        raise SystemExit(f"--batch {args.batch} must divide by the {p} devices")

    class MLP(nn.Module):
        width: int = 64

        @nn.compact
        def __call__(self, x):
            x = nn.gelu(nn.Dense(self.width)(x))
            x = nn.gelu(nn.Dense(self.width)(x))
            return nn.Dense(4)(x)

    rng = np.random.default_rng(args.seed)
    teacher_w1 = rng.standard_normal((16, 32)).astype(np.float32) / 4
    teacher_w2 = rng.standard_normal((32, 4)).astype(np.float32) / np.sqrt(32)
    batches = []
    for _ in range(args.steps):
        x = rng.standard_normal((args.batch, 16)).astype(np.float32)
        batches.append((x, np.tanh(x @ teacher_w1) @ teacher_w2))

    model = MLP()
    params0 = model.init(jax.random.PRNGKey(args.seed), jnp.zeros((1, 16)))
    tx = optax.adam(args.lr)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    def make_step(reduce):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("data"), P("data"), P("data"), P()),
                           out_specs=(P(), P(), P("data"), P("data")))
        def step(params, opt_state, fb, x, y, k):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            grads, fb = reduce(grads, fb, k)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, fb, jax.lax.pmean(loss, "data")[None]
        return step

    def lax_reduce(grads, fb, k):
        return jax.lax.pmean(grads, "data"), fb

    def gift_reduce(grads, fb, k):
        kw = dict(fmt=args.fmt, rounding=args.rounding)
        if args.rounding == "stochastic":
            kw["seed"] = k  # the traced step number: one compiled step, a new rounding every step
        if not args.feedback:
            return gj.pmean(grads, "data", **kw), fb
        grads, state = gj.pmean(grads, "data", feedback=jax.tree_util.tree_map(lambda s: s[0], fb), **kw)
        return grads, jax.tree_util.tree_map(lambda s: s[None], state)

    def train(reduce, fb_spec):
        step = make_step(reduce)
        params, opt_state = params0, tx.init(params0)
        fb = fb_spec
        shard = NamedSharding(mesh, P("data"))
        losses = []
        for k, (x, y) in enumerate(batches):
            params, opt_state, fb, loss = step(params, opt_state, fb, jax.device_put(x, shard),
                                               jax.device_put(y, shard), jnp.uint32(k))
            losses.append(float(np.asarray(loss)[0]))
        return losses

    # the error-feedback state: one residual per device, held outside shard_map with a leading
    # device axis (each device sees (1, *shape)); without feedback a placeholder of the same form
    fb0 = jax.device_put(gj.feedback_init(params0, copies=p), NamedSharding(mesh, P("data")))

    base = train(lax_reduce, fb0)
    gift = train(gift_reduce, fb0)
    tail = min(20, len(base))
    lb, lg = float(np.mean(base[-tail:])), float(np.mean(gift[-tail:]))
    rel = abs(lg - lb) / lb
    print(f"devices {p} ({devices[0].platform}), steps {args.steps}, global batch {args.batch}, "
          f"fmt {args.fmt}, rounding {args.rounding}, feedback {args.feedback}")
    print(f"initial loss {base[0]:.5f}")
    print(f"lax.pmean final loss {lb:.5f}")
    print(f"giftcomm pmean final loss {lg:.5f}")
    print(f"relative difference {rel:.4f} (tolerance {args.tolerance})")
    return 0 if rel <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
