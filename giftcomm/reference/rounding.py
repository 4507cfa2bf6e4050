"""Keys of stochastic rounding in the collectives: which random bits each encode uses.

The codec's stochastic rounding draws the bits of element i from Philox4x32-10 with a 64-bit key
and the element's index as the counter (giftcomm.reference.codec). A collective fixes both:

- the counter is the element's index in the caller's flat buffer, so a value gets the same bits
  however the buffer is cut into chunks and slices;
- the key mixes the caller's ``seed`` (one per call, e.g. the training step) with the *party*
  that encodes (normally its rank) and a *stage* (0, except in recursive doubling, whose rounds
  re-encode the same elements): every rank's messages round independently, while ranks that
  must produce identical bytes (a doubling group holding one partial sum) share a party.

The simulations (giftcomm.reference.simulate) and the distributed algorithms use this one
function, so stochastic results stay bit-identical to the simulation and across ranks.
"""
from __future__ import annotations

__all__ = ["call_key", "mix64"]

_MASK = (1 << 64) - 1


def mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints that spreads every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def call_key(seed: int, party: int, stage: int = 0) -> int:
    """The Philox key (an int in [0, 2**64)) of ``party``'s encodes at ``stage`` of a call with
    ``seed`` (an int in [0, 2**64))."""
    return mix64(mix64(seed & _MASK) ^ mix64(((party & 0xFFFFFFFF) << 32) | (stage & 0xFFFFFFFF)))
