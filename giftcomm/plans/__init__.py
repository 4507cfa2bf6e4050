"""The plans floor of a call: persistent plans (:mod:`giftcomm.plans.persistent`: check and
agree once, then repeat the same call cheaply) and the plain calls' plan cache
(:mod:`giftcomm.plans.cache`, with its miss path). Every call of giftcomm.api goes through the
cache, and only this floor and the api call the engine's entries (``engine.execute``,
``engine.agree_call``): docs/architecture.md, "Floors of a call"."""
