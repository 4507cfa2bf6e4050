"""Framework adapters: ``giftcomm.adapters.torch`` (DDP comm hook, gradient synchroniser for
plain loops, KFAC capture hooks) and ``giftcomm.adapters.jax`` (pytrees of gradients).

Each adapter imports its framework, so import the one you use; this package imports neither.
See docs/adapters.md.
"""
