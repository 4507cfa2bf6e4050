"""giftcomm: geometry-informed FP8 gradient collectives.

Ring allreduce with FP8 wire messages (block-scaled E4M3/E5M2, fp32 accumulation at every hop)
over MPI, and GIFT: quantization in near-isotropic coordinates given by a per-layer geometry.
"""
from .accounting import reset_stats, stats
from .algorithms.partition import chunk_bounds
from .api import allgather, allreduce, gift_allreduce, reduce_scatter
from .errors import CommAborted, CommClosed, CommTimeout
from .formats import FORMATS, bytes_per_value, message_nbytes
from .geometry import Geometry, GiftSchedule
from .plans.persistent import AllreducePlan, plan_allreduce
from .reference.simulate import resolve_algorithm, simulate_allreduce
from .transport import LoopbackGroup, Transport, release

try:  # one place for the version: pyproject.toml, read back from the installed package's metadata
    from importlib.metadata import PackageNotFoundError as _NotInstalled
    from importlib.metadata import version as _version

    __version__ = _version("giftcomm")
except _NotInstalled:  # a source tree on sys.path that pip has not installed
    __version__ = "0+unknown"

__all__ = ["allreduce", "gift_allreduce", "reduce_scatter", "allgather", "plan_allreduce", "AllreducePlan", "release", "CommTimeout",
           "CommAborted", "CommClosed", "Geometry", "GiftSchedule",
           "chunk_bounds", "message_nbytes", "bytes_per_value", "FORMATS", "LoopbackGroup",
           "Transport", "resolve_algorithm", "simulate_allreduce", "stats", "reset_stats", "__version__"]
