"""The algorithm table and what its formulas take (see giftcomm.algorithms.table).

- :mod:`giftcomm.algorithms.table`: one row per allreduce algorithm (``Algorithm``, ``BY_NAME``,
  ``CHOICES``, ``register``, ...), the only place an algorithm's facts are written; its names
  are handed on here, so ``from giftcomm.algorithms import BY_NAME`` reads the table.
- :mod:`giftcomm.algorithms.machine`: the machine records the cost formulas take
  (``Calibration``, ``LinkCost``, ``Topology``).
- :mod:`giftcomm.algorithms.partition`: how a flat buffer is split into rank chunks.

The cost model that predicts with the table and picks ``auto`` is giftcomm.cost.
"""
from .table import (
    AUTO,
    AUTO_CODE,
    BUILT_IN,
    BY_CODE,
    BY_NAME,
    CHOICES,
    CODES,
    FUSED_ROUTES,
    NAMES,
    NATIVE,
    SCATTER_CHOICES,
    TABLE,
    Algorithm,
    native_bytes,
    register,
    row,
    unregister,
)

__all__ = ["Algorithm", "FUSED_ROUTES", "BUILT_IN", "register", "unregister", "TABLE", "NAMES", "CHOICES",
           "SCATTER_CHOICES", "AUTO", "AUTO_CODE", "BY_NAME", "BY_CODE", "CODES", "NATIVE", "row", "native_bytes"]
