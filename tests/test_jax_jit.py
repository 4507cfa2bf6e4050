"""giftcomm.adapters.jax's jit path (psum, pmean, psum_scatter; the jnp codec) on 8 CPU host devices.

The checks live in tests/jax_jit_cases.py and run once in a subprocess (XLA_FLAGS must be set
before jax is imported; this process may have imported jax already): every format variant's
jnp codec equals the reference byte for byte; psum/pmean on P = 1..8 devices (1-D meshes, pytrees
of float32 and bfloat16 leaves of odd sizes, ring and direct, nearest and stochastic) equal
simulate_allreduce bit for bit on every device; a 2x4 mesh (a tuple of axes, one axis,
psum_scatter tiled and not) equals the reference and lax's shapes; the compiled program's
collective-permutes and all-gathers carry uint8; bad input fails while tracing; traced seeds,
error feedback and GIFT geometries (extras/) equal the reference, ErrorFeedback and the NumPy
geometry path. test_two_processes runs psum / pmean across two jax.distributed processes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# one xdist worker runs every test here (--dist loadgroup): the module-scoped fixture (the jit cases'
# one subprocess: about 50 s of compiling) is then made once, not once per worker
pytestmark = pytest.mark.xdist_group("jax_jit")

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



def test_two_processes():
    """psum / pmean over a 4-device mesh spanning two jax.distributed processes (CPU, gloo
    collectives, 2 host devices each) equal simulate_allreduce on every device of both
    (tests/jax_dist_case.py)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    script = str(ROOT / "tests" / "jax_dist_case.py")
    procs = [subprocess.Popen([sys.executable, script, str(port), str(pid)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    results: dict = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-4000:]
            results.update(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert len(results) == 4, results
    failed = {k: v for k, v in results.items() if not v[0]}
    assert not failed, failed
