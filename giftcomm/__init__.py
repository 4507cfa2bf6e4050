"""giftcomm: geometry-informed FP8 gradient collectives.

Ring allreduce with FP8 wire messages (block-scaled E4M3/E5M2, fp32 accumulation at every hop)
over MPI, and GIFT: quantization in near-isotropic coordinates given by a per-layer geometry.
"""
import importlib as _importlib
import importlib.abc as _abc
import importlib.machinery as _machinery
import importlib.util as _util
import sys as _sys
import types as _types
import warnings as _warnings

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

#: Module paths that moved when the package root was sorted into rooms: the old path still imports,
#: for one release, as the new module itself, with a DeprecationWarning (no file stays behind).
MOVED_MODULES = {
    "giftcomm.costmodel": "giftcomm.cost.model",
    "giftcomm.calibration": "giftcomm.cost.calibration",
    "giftcomm.machine": "giftcomm.algorithms.machine",
    "giftcomm.partition": "giftcomm.algorithms.partition",
    "giftcomm.baselines": "giftcomm.collectives.baselines",
    "giftcomm.feedback": "giftcomm.collectives.feedback",
    "giftcomm.persistent": "giftcomm.plans.persistent",
    "giftcomm.plan_cache": "giftcomm.plans.cache",
    "giftcomm.adapters.jax_jit": "giftcomm.adapters.jax.jit",
    "giftcomm.adapters.jax_codec": "giftcomm.adapters.jax.codec",
    "giftcomm.adapters.jax_geometry": "giftcomm.adapters.jax.geometry",
}


class _MovedModuleFinder(_abc.MetaPathFinder, _abc.Loader):
    """Imports an old path of :data:`MOVED_MODULES` as its new module (consulted after every other
    finder, so only for names no file answers)."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> _machinery.ModuleSpec | None:
        return _util.spec_from_loader(name, self) if name in MOVED_MODULES else None

    def create_module(self, spec: _machinery.ModuleSpec) -> _types.ModuleType:
        new = MOVED_MODULES[spec.name]
        _warnings.warn(f"{spec.name} is now {new}; the old path goes in the next release", DeprecationWarning,
                       stacklevel=2)
        return _importlib.import_module(new)

    def exec_module(self, module: _types.ModuleType) -> None:
        """The new module is already executed."""


if not any(isinstance(f, _MovedModuleFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedModuleFinder())

__all__ = ["allreduce", "gift_allreduce", "reduce_scatter", "allgather", "plan_allreduce", "AllreducePlan", "release", "CommTimeout",
           "CommAborted", "CommClosed", "Geometry", "GiftSchedule",
           "chunk_bounds", "message_nbytes", "bytes_per_value", "FORMATS", "LoopbackGroup",
           "Transport", "resolve_algorithm", "simulate_allreduce", "stats", "reset_stats", "__version__"]
