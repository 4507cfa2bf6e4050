"""Shared fixtures and the tables the tests parametrise over.

``rng``: a fresh random generator per test, its seed printed so a failure can be replayed.
FORMAT_NAMES, ALGORITHM_NAMES, ALGORITHM_CHOICES, SCATTER_ALGORITHMS: read from the format table
(giftcomm.formats.FORMATS) and the algorithm table (giftcomm.algorithms), so a new row
is tested everywhere the day it lands; no test file writes these lists by hand. ``covering``
builds a covering design over them (every format x every algorithm once, other axes rotating).
Which module is the home of which invariant (docs/architecture.md): tests/README.md.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import warnings

import numpy as np
import pytest

# The NumPy fallback warns once when the native codec is missing; tests compare both paths anyway.
warnings.filterwarnings("ignore", message="giftcomm: native codec extension not built")


_TORCH_RNG = threading.Lock()


@contextlib.contextmanager
def torch_seeded(seed: int):
    """torch's process-global generator seeded with ``seed`` for the block, one thread at a time,
    and restored after: LoopbackGroup runs its ranks as threads, so a bare torch.manual_seed in a
    rank's body races with the other ranks' draws (two runs built different models)."""
    import torch

    with _TORCH_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _native_isas() -> list:
    try:
        from giftcomm import _codec_native
    except ImportError:  # the optional build is missing: the native tests skip themselves
        return []
    return list(_codec_native._isas())


@pytest.fixture(params=_native_isas())
def isa(request):
    """Run the test with one native kernel variant (generic, avx2, avx512, as the build and the CPU
    have them) selected; restore the default afterwards."""
    from giftcomm import _codec_native

    before = _codec_native._isa()
    _codec_native._set_isa(request.param)
    yield request.param
    _codec_native._set_isa(before)


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int(os.environ.get("GIFTCOMM_TEST_SEED", np.random.SeedSequence().entropy % (2**32)))
    print(f"[{request.node.name}] seed={seed} (replay with GIFTCOMM_TEST_SEED={seed})")
    return np.random.default_rng(seed)


# ------------------------------------------------------------------ the tables, as test axes
from giftcomm.algorithms import BY_NAME, CHOICES, NAMES, SCATTER_CHOICES  # noqa: E402
from giftcomm.formats import FORMATS  # noqa: E402

#: every wire format of the table, in table order
FORMAT_NAMES: list[str] = list(FORMATS)
#: the block-scaled formats (the ones stochastic rounding and block NaN rules apply to)
SCALED_FORMATS: list[str] = [name for name, f in FORMATS.items() if f.scaled]
#: every allreduce algorithm of the table, and the ``algorithm=`` choices ("auto" first)
ALGORITHM_NAMES: list[str] = list(NAMES)
ALGORITHM_CHOICES: list[str] = list(CHOICES)
#: giftcomm's own reduce-scatter algorithms (the first half of their allreduce; the shared-window
#: path takes them), without "auto"; the transport's own ("native") is tested in test_native.py
SCATTER_ALGORITHMS: list[str] = [a for a in SCATTER_CHOICES if a in BY_NAME and not BY_NAME[a].native]
#: the pass-through formats (no scales: a plain cast; bf16, fp16, fp32 today)
PASS_THROUGH_FORMATS: list[str] = [name for name, f in FORMATS.items() if not f.scaled]
#: the scaled formats that take any block (one float32 scale per block: e4m3, e5m2 today)
ANY_BLOCK_FORMATS: list[str] = [name for name, f in FORMATS.items() if f.scaled and f.fixed_block is None]
#: the formats with a block size of their own (nvfp4 and the MX formats today)
FIXED_BLOCK_FORMATS: list[str] = [name for name, f in FORMATS.items() if f.fixed_block is not None]
#: the formats with E8M0 shared exponents, the ones an MX scale rule applies to
E8M0_FORMATS: list[str] = [name for name, f in FORMATS.items() if f.scale_kind == "e8m0"]
#: the 4-bit formats
FOUR_BIT_FORMATS: list[str] = [name for name, f in FORMATS.items() if f.value_bits == 4]
#: one scaled format per (scale kind, element width), the first in table order: every scale rule
#: and element width at a fraction of the cost of all of them (e4m3, nvfp4, mxfp4, mxfp8 today)
_FIRST_OF_KIND: dict[tuple[str, int], str] = {}
for _name, _f in FORMATS.items():
    if _f.scaled:
        _FIRST_OF_KIND.setdefault((_f.scale_kind, _f.value_bits), _name)
SCALED_SAMPLE: list[str] = list(_FIRST_OF_KIND.values())
#: giftcomm's own allreduce algorithms (every row but the transport's own, "native")
OWN_ALGORITHMS: list[str] = [a for a in ALGORITHM_NAMES if not BY_NAME[a].native]


def native_only(names: list[str]) -> list[str]:
    """The formats of ``names`` that the C and CUDA kernels implement (Format.native; the adaptive
    rows have C kernels only: tests/test_adaptive_native.py)."""
    return [name for name in names if FORMATS[name].native and FORMATS[name].adaptive is None]


#: a format name no table row will ever take, for the tests of an unknown format's error (a
#: plausible name such as "e3m4" would start passing the day that format is added)
UNKNOWN_FORMAT = "not-a-format"


def covering(first: list, second: list, *rotating: list) -> list[tuple]:
    """Every pair of ``first`` x ``second`` once, each followed by one value of every list in
    ``rotating``, chosen so that every value of a rotating list meets every value of ``first``
    and of ``second`` when the lists allow it (index ``(i + (k + 1) * j) % len`` for pair (i, j)):
    a covering design that keeps a product over the tables cheap."""
    out = []
    for (i, a), (j, b) in itertools.product(enumerate(first), enumerate(second)):
        out.append((a, b, *(r[(i + (k + 1) * j) % len(r)] for k, r in enumerate(rotating))))
    return out


# ------------------------------------------------------------------ the test tiers
#: The fast tier (`bash tests/run_all.sh`, README.md): the tables, the codecs and the home modules
#: of the invariants of DESIGN.md (tests/README.md), with their MPI tests; `--full` runs every
#: module. This list is the one definition: run_all.sh reads it, and the hook below marks its
#: tests `fast` (`pytest -m fast`).
FAST_MODULES: list[str] = [
    "test_repo.py",
    "test_format_table.py",
    "test_algorithm_table.py",
    "test_algorithm_row.py",
    "test_codec_reference.py",  # invariant 3: the reference codec against ml_dtypes
    "test_native_codec.py",  # invariant 3: the C kernels against the reference
    "test_collectives.py",  # invariant 2: every format x algorithm == the simulation
    "test_mpi_collectives.py",  # invariant 1: bit-identical ranks under mpiexec
    "test_geometry_mpi.py",  # invariant 4 under mpiexec; its home module test_geometry.py, with
    # minutes-long whitening and policy tests, is in the full tier only
    "test_errors_everywhere.py",  # invariant 5
    "test_fp32_accumulation.py",  # invariant 6
    "test_cost_model.py",
]


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config, items):
    fast = pytest.mark.fast
    for item in items:
        if item.path.name in FAST_MODULES:
            item.add_marker(fast)


MPI_WORLD_SIZES = 5


def on_this_world(i: int, size: int) -> bool:
    """Whether case ``i`` of a covering design runs at world size ``size`` under mpiexec: the
    cases are dealt round-robin over P = 1..MPI_WORLD_SIZES (tests/run_all.sh runs each), so the
    union of those runs covers every case once and each run stays small."""
    return i % MPI_WORLD_SIZES == (size - 1) % MPI_WORLD_SIZES


def block_for(fmt: str, block: int | None) -> int | None:
    """``block`` for a format that takes any block, None (the format's own) for a fixed-block one."""
    return None if FORMATS[fmt].fixed_block is not None else block


def local_sizes(algorithm: str, p: int) -> list:
    """Node layouts to run ``algorithm`` with on P ranks: every divisor of P for the rows that
    need nodes, else [None]."""
    if algorithm not in BY_NAME or not BY_NAME[algorithm].needs_nodes:
        return [None]
    return [k for k in range(1, p + 1) if p % k == 0]


# ------------------------------------------------------------------ helpers the test files share
def same(a, b) -> bool:
    """Bit-identical arrays: dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def outcomes(p: int, fn, group=None) -> list:
    """Every rank's result or exception (TypeError/ValueError/RuntimeError) of ``fn(transport)``
    on P in-process ranks (``group``: a LoopbackGroup class, the pipelined one by default); the
    loopback itself re-raises only the first exception."""
    from giftcomm import LoopbackGroup

    def body(t):
        try:
            return fn(t)
        except (TypeError, ValueError, RuntimeError) as exc:
            return exc
    return (group or LoopbackGroup)(p).run(body)


def assert_same_error(errors: list, cls: type, *fragments: str) -> None:
    """Every rank raised ``cls`` with one and the same message, containing ``fragments``."""
    assert all(type(e) is cls for e in errors), errors
    assert len({str(e) for e in errors}) == 1, [str(e) for e in errors]
    for frag in fragments:
        assert frag in str(errors[0]), (frag, str(errors[0]))


def spawn_ranks(world: int, tmp_path, process_args) -> list:
    """Run ``world`` spawned processes (torch's spawn context); ``process_args(rank, out_file)``
    gives each one's (target, args), and the target pickles its result into ``out_file``. Every
    process must exit 0 within 240 s (a late one is killed); returns the results in rank order."""
    import pickle

    import torch

    ctx = torch.multiprocessing.get_context("spawn")
    outs = [os.path.join(tmp_path, f"rank{r}.pkl") for r in range(world)]
    procs = []
    for r in range(world):
        target, args = process_args(r, outs[r])
        procs.append(ctx.Process(target=target, args=args))
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(240)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    codes = [proc.exitcode for proc in procs]
    assert codes == [0] * world, f"rank exit codes {codes}"
    res = []
    for f in outs:
        with open(f, "rb") as fh:
            res.append(pickle.load(fh))
    return res


def scale_rule_edges(rng: np.random.Generator, fmt: str) -> np.ndarray:
    """Three whole chunks and a partial one whose 32-value blocks have an amax at the scale rules'
    edges: max * 2^k exactly and one ulp either side, powers of two and one ulp below, random
    mantissas, the top float32 binade (ceil keeps the floor code there), the bottom of the E8M0
    range, float32 subnormals, zero; the other values random below the amax."""
    from giftcomm.formats import get_format

    f = get_format(fmt)
    n = 3 * 1024 + 45
    nb = -(-n // 32)
    top = np.finfo(np.float32).max
    amaxes = []
    for b in range(nb):
        k = int(rng.integers(-140, 127))
        m = np.float32(f.max_value * 2.0 ** max(min(k, 110), -130))
        kind = b % 9
        a = [m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(0)), np.float32(2.0 ** max(k, -149)),
             np.nextafter(np.float32(2.0 ** max(k, -148)), np.float32(0)), np.float32(rng.uniform(1, 2) * 2.0**k),
             np.float32(rng.uniform(2.0**127, top)), np.float32(f.max_value * 2.0**-127 * rng.uniform(0.5, 2)),
             np.float32(0.0)][kind]
        amaxes.append(a)
    x = np.empty(nb * 32, np.float32)
    for b, a in enumerate(amaxes):
        blk = (rng.uniform(-1, 1, 32) * np.float64(a)).astype(np.float32)
        blk[rng.integers(32)] = a * np.float32(rng.choice([-1, 1]))
        x[32 * b:32 * b + 32] = blk
    return x[:n]


_SHM_AT_START: set[str] = set()


def _segment_files() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def pytest_sessionstart(session):
    _SHM_AT_START.update(_segment_files())


def pytest_sessionfinish(session, exitstatus):
    """Leave /dev/shm as the run found it: remove MPICH segment files that appeared during the run
    and that no live process maps (left by ranks a test killed or ended with os._exit). Under
    pytest-xdist only the controller does this, once every worker has finished."""
    if hasattr(session.config, "workerinput"):
        return
    new = _segment_files() - _SHM_AT_START
    if not new:
        return
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped.update(name for name in new if name in f.read())
        except OSError:
            continue
    for name in new - mapped:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
