"""Shared fixtures: a fresh random generator per test, its seed printed so a failure can be replayed."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

# The NumPy fallback warns once when the native codec is missing; tests compare both paths anyway.
warnings.filterwarnings("ignore", message="giftcomm: native codec extension not built")


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("GIFTCOMM_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
    print(f"[{request.node.name}] seed={seed} (replay with GIFTCOMM_TEST_SEED={seed})")
    return np.random.default_rng(seed)
