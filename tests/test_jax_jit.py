"""giftcomm.adapters.jax's jit path (psum, pmean, psum_scatter; the jnp codec) on 8 CPU host devices.

The checks live in tests/jax_jit_cases.py and run once in a subprocess (XLA_FLAGS must be set
before jax is imported; this process may have imported jax already): every format variant's
jnp codec equals the reference byte for byte; psum/pmean on P = 1..8 devices (1-D meshes, pytrees
of float32 and bfloat16 leaves of odd sizes, ring and direct, nearest and stochastic) equal
simulate_allreduce bit for bit on every device; a 2x4 mesh (a tuple of axes, one axis,
psum_scatter tiled and not) equals the reference and lax's shapes; the compiled program's
collective-permutes and all-gathers carry uint8; bad input fails while tracing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "jax_jit_cases.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


GROUPS = ["codec/", "P1/", "P2/", "P3/", "P4/", "P5/", "P6/", "P7/", "P8/", "2d/", "extras/P1/", "extras/P4/", "hlo/",
          "error/"]


@pytest.mark.parametrize("group", GROUPS)
def test_jit_path(results, group):
    cases = {k: v for k, v in results.items() if k.startswith(group)}
    assert cases, f"no case of {group} ran"
    failed = {k: v[1] for k, v in cases.items() if not v[0]}
    assert not failed, failed

