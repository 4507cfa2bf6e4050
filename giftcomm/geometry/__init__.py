"""GIFT geometry: per-segment linear transforms of the gradient buffer (KFAC whitening, low-rank,
diagonal, randomised Hadamard), the estimators of their factors and the selective policy.

See docs/method.md (the method and its choices) and docs/geometry.md (API reference).
"""
from .estimators import GradientFactorEstimator, KfacEstimator, row_col_mean_squares
from .geometry import Geometry
from .layout import Layout, Segment
from .paper import FactorEMA, InputFactorEstimator, PaperOptions, SaturationProfile, paper_geometry, paper_sharded, refresh_geometry
from .policy import SelectivePolicy, TransformTimeModel, collective_seconds, select
from .schedule import GiftSchedule, schedule_of
from .sharded import ShardedGeometry, shard_layout
from .spectral import Spectrum
from .sync import SyncReport

__all__ = ["Geometry", "Layout", "Segment", "Spectrum", "KfacEstimator", "GradientFactorEstimator", "SyncReport", "SelectivePolicy",
           "GiftSchedule", "schedule_of",
           "ShardedGeometry", "shard_layout", "PaperOptions", "InputFactorEstimator", "SaturationProfile",
           "paper_geometry", "paper_sharded", "refresh_geometry", "FactorEMA",
           "select", "TransformTimeModel", "collective_seconds", "row_col_mean_squares"]
