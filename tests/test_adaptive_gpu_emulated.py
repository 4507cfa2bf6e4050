"""The adaptive rows' CUDA kernels (giftcomm/cuda/kernels/gc_adaptive.cuh, launched by
giftcomm.cuda.adaptive) on the CPU (marker ``emulated_gpu``): the source text NVRTC gets, built
against tests/emulator/simt.h and run through the CuPy stand-in (tests/emulator/fake_cupy.py),
against giftcomm.reference.adaptive bit for bit (decoded NaNs compared as NaNs: payload bits
aside) on fresh random data: the table's rows and rows of a few super-blocks per frame (several
frames, a partial last one), heavy-tailed, NaN / Inf / zero / tiny super-blocks, amax ties,
nearest and stochastic rounding, all four ops, a corrupt message, and a run under
AddressSanitizer.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from giftcomm import codec as gc
from giftcomm.adaptive import AdaptiveSpec
from giftcomm.cuda import adaptive as cuda_adaptive
from giftcomm.cuda import codec as cuda_codec
from giftcomm.formats import FORMATS, Format, message_nbytes
from giftcomm.reference import codec as ref
from tests.test_gpu_emulated import ROOT, _libasan, install

pytestmark = pytest.mark.emulated_gpu

TABLE = ("ada4_5", "ada4")
SR = dict(rounding="stochastic", key=0x9E3779B97F4A7C15, offset=(1 << 32) - 300)


def _row(budget: int, frame: int, share: int, block: int = 256) -> Format:
    """An adaptive row with INT8 / INT4 tiers (the kernels' rows) and small frames."""
    f = FORMATS["ada4_5"]
    return replace(f, name=f"ada_{budget}_{frame}_{share}_{block}", fixed_block=block,
                   adaptive=AdaptiveSpec(budget, frame, share, "int8", "int4"))


# (1, 4, 3), (3, 7, 6) and (2, 6, 8) super-blocks at 8/4/2 bits in a full frame
SMALL = (_row(4500, 8, 600), _row(4500, 16, 600), _row(4000, 16, 500))


@pytest.fixture
def cp(monkeypatch):
    return install(monkeypatch)


def _nasty(rng: np.random.Generator, n: int, block: int) -> np.ndarray:
    """Heavy-tailed values whose super-blocks span many binades, with NaN, Inf, zero, tiny
    (2**-110) and subnormal super-blocks and super-blocks of equal amax (ties)."""
    nsb = -(-n // block)
    x = (rng.standard_t(1.5, n) * np.repeat(10.0 ** rng.uniform(-4, 4, nsb), block)[:n]).astype(np.float32)
    kinds = rng.integers(0, 8, nsb)
    for b in range(nsb):
        lo, hi = b * block, min(n, (b + 1) * block)
        k = kinds[b]
        if k == 0:
            x[rng.integers(lo, hi)] = rng.choice([np.nan, -np.nan, np.inf, -np.inf])
        elif k == 1:
            x[lo:hi] = 0
        elif k == 2:
            x[lo:hi] *= np.float32(2.0**-110) / max(np.float32(1), np.abs(x[lo:hi]).max())
        elif k == 3:
            x[lo:hi] = rng.standard_normal(hi - lo).astype(np.float32) * np.float32(2.0**-140)  # subnormals
        elif k in (4, 5):  # amax exactly 7.5 (ties between these super-blocks)
            v = x[lo:hi]
            v *= np.float32(7.0) / max(np.float32(1e-30), np.abs(v).max())
            v[rng.integers(0, hi - lo)] = rng.choice([np.float32(7.5), np.float32(-7.5)])
    return x


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """float32 arrays equal bit for bit, NaN against any NaN."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN positions differ"
    bad = np.flatnonzero(got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan])
    assert bad.size == 0, f"{what}: {bad.size} values differ, first at {np.flatnonzero(~nan)[bad[:5]]}"


def _check_ops(cp, rng, x: np.ndarray, f: Format, what: str, msg_offset: int = 0) -> None:
    """encode (nearest, stochastic), decode, decode-accumulate, decode-add-encode (with and without
    sum_out) on the device against the reference; the message at byte ``msg_offset`` of its buffer."""
    n = x.size
    block = f.default_block()
    size = message_nbytes(n, f, block)
    for kw in ({}, SR):
        rnd = "stochastic" if kw else "nearest"
        want = ref.encode(x, f, block, **kw)
        buf = cp.full(size + msg_offset, 0xA5, cp.uint8)
        got = gc.encode(cp.asarray(x), f, block, out=buf[msg_offset:], **kw)
        b = cp.asnumpy(got)
        bad = np.flatnonzero(b != want)
        assert bad.size == 0, f"{what} {rnd}: {bad.size} message bytes differ, first at {bad[:8]} of {size}"
        dev_msg = buf[msg_offset:]
        _same(cp.asnumpy(gc.decode(dev_msg, n, f, block)), ref.decode(want, n, f, block), f"{what} {rnd} decode")
        acc0 = rng.standard_normal(n).astype(np.float32)
        acc = cp.asarray(acc0)
        gc.decode_accumulate(dev_msg, acc, f, block)
        with np.errstate(invalid="ignore", over="ignore"):
            _same(cp.asnumpy(acc), acc0 + ref.decode(want, n, f, block), f"{what} {rnd} decode_accumulate")
        local = (rng.standard_normal(n) * 4).astype(np.float32)
        hop = ref.decode_add_encode(want, local, f, block, **kw)
        s = cp.full(n, cp.nan, cp.float32)
        got = cp.asnumpy(gc.decode_add_encode(dev_msg, cp.asarray(local), f, block, sum_out=s, **kw))
        assert np.array_equal(got, hop), f"{what} {rnd} decode_add_encode"
        with np.errstate(invalid="ignore", over="ignore"):
            _same(cp.asnumpy(s), ref.decode(want, n, f, block) + local, f"{what} {rnd} sum_out")
        got = cp.asnumpy(gc.decode_add_encode(dev_msg, cp.asarray(local), f, block, **kw))
        assert np.array_equal(got, hop), f"{what} {rnd} decode_add_encode without sum_out"


def test_kernel_tier_facts_are_the_rules():
    """gc_adaptive.cuh's tier table (group, bits, largest element, super-scale divisor) and choice
    codes are giftcomm.adaptive's."""
    from giftcomm import adaptive as a

    text = (Path(cuda_adaptive.__file__).parent / "kernels" / "gc_adaptive.cuh").read_text()
    rows = re.findall(r"t\.group = (\d+); t\.bits = (\d+); t\.emax = ([\d.]+)f; t\.sdiv = ([\d.]+)f;", text)
    want = [(a.T8_INT_GROUP, 8, a.T8_INT_MAX), (a.T4_GROUP, 4, a.T4_INT_MAX), (a.T2_GROUP, 2, a.T2_MAX)]
    assert [(int(g), int(b), float(m), float(d)) for g, b, m, d in rows] == [
        (g, b, float(m), 448.0 * m) for g, b, m in want]
    codes = dict(re.findall(r"#define GC_ADA_TIER_(T\d) (\d)", text))
    assert codes == {"T2": str(a.TIER_T2), "T4": str(a.TIER_T4), "T8": str(a.TIER_T8)}
    assert f"#define GC_ADA_THREADS {cuda_adaptive._THREADS}" in text


@pytest.mark.parametrize("fmt", TABLE)
def test_table_rows_bit_for_bit(cp, fmt, rng):
    """ada4_5 / ada4 (one frame of up to 65536 super-blocks): one super-block, a partial one, many."""
    f = FORMATS[fmt]
    for n in (1, 200, 256, 257, 3000 + int(rng.integers(0, 256))):
        _check_ops(cp, rng, _nasty(rng, n, 256), f, f"{fmt} n={n}")
    x = (rng.standard_normal(5000) * 3).astype(np.float32)  # plain Gaussian: every tier in use
    _check_ops(cp, rng, x, f, f"{fmt} gaussian", msg_offset=3)


@pytest.mark.parametrize("f", SMALL, ids=lambda f: f.name)
def test_several_frames_and_a_partial_last_frame(cp, f, rng, monkeypatch):
    """Rows of 8 / 16 super-blocks per frame: exact frames, a partial last frame, one partial
    frame; sort runs of 2 frames (the key's frame field wraps between runs); a 3-CTA grid (every
    grid-stride loop iterates); the message at an odd byte."""
    monkeypatch.setattr(cuda_adaptive, "_RUN_FRAMES", 2)
    monkeypatch.setattr(cuda_adaptive, "_MAX_GRID", 3)
    F = f.adaptive.frame
    for nsb in (1, F - 1, F, 2 * F, 5 * F + 3):
        n = nsb * 256 - int(rng.integers(0, 200))
        _check_ops(cp, rng, _nasty(rng, n, 256), f, f"{f.name} n={n}", msg_offset=int(rng.integers(0, 4)))


def test_all_super_blocks_tied(cp, rng):
    """Every super-block the same amax (ranks by index alone) and every one non-finite."""
    f = SMALL[1]
    x = (rng.uniform(-1, 1, 40 * 256)).astype(np.float32)
    x[::256] = np.float32(2.5)
    _check_ops(cp, rng, x, f, "tied")
    x[1::256] = np.nan
    _check_ops(cp, rng, x, f, "all NaN")


def test_subnormals_under_ftz_cupy(monkeypatch, rng):
    """With the stand-in's CuPy arithmetic flushing float32 subnormals (-ftz=true, as CuPy's own
    kernels do), the bytes and values stay the reference's: no float32 CuPy operation on the
    adaptive path (the launch code's CuPy work is on integers)."""
    cp = install(monkeypatch, ftz=True)
    x = _nasty(rng, 20 * 256 + 9, 256)
    x[::7] *= np.float32(2.0**-126)  # subnormal inputs in every super-block
    _check_ops(cp, rng, x, SMALL[2], "ftz")


def test_block_of_384(cp, rng):
    """A block that is not a power of two (three rounds of 128 threads per super-block)."""
    f = _row(4500, 8, 600, block=384)
    for n in (100, 384 * 19 + 7):
        _check_ops(cp, rng, _nasty(rng, n, 384), f, f"block 384 n={n}")


def test_corrupt_choice_bits_raise(cp, rng):
    """A frame whose choice bits give other tier counts: the reference's ValueError, from decode,
    decode-accumulate and decode-add-encode."""
    f = SMALL[0]
    n = 3 * 8 * 256
    x = _nasty(rng, n, 256)
    msg = ref.encode(x, f)
    fb = f.adaptive.frame_nbytes(8, 256)
    for frame in range(3):
        for change in (0x01, 0x03, 0xFF):
            bad = msg.copy()
            bad[frame * fb] ^= np.uint8(change)  # super-blocks 0..3 of the frame
            with pytest.raises(ValueError, match="corrupt adaptive message"):
                ref.decode(bad, n, f)
            d = cp.asarray(bad)
            with pytest.raises(ValueError, match="corrupt adaptive message"):
                gc.decode(d, n, f)
            with pytest.raises(ValueError, match="corrupt adaptive message"):
                gc.decode_accumulate(d, cp.zeros(n, cp.float32), f)
            with pytest.raises(ValueError, match="corrupt adaptive message"):
                gc.decode_add_encode(d, cp.zeros(n, cp.float32), f)


@pytest.mark.parametrize("fmt", TABLE)
def test_table_rows_run_on_the_kernels_not_host_copies(cp, fmt, rng, monkeypatch, caplog):
    """The CuPy backend runs ada4_5 / ada4 on the CUDA kernels: no host-copy warning, the
    fallback never called, the adaptive kernels launched."""
    f = FORMATS[fmt]
    assert cuda_codec.supports(f) and fmt in cuda_codec.CUDA_FORMATS

    def refuse(*a, **k):
        raise AssertionError("host-copy fallback used")

    for op in ("encode", "decode", "decode_add_encode", "decode_accumulate"):
        monkeypatch.setattr(gc.DeviceFallbackKernels, op, staticmethod(refuse))
    monkeypatch.setattr(gc, "_cuda_fallback_logged", set())
    x = (rng.standard_normal(2000) * 2).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="giftcomm"):
        m = gc.encode(cp.asarray(x), fmt)
        gc.decode(m, x.size, fmt)
        gc.decode_add_encode(m, cp.asarray(x), fmt, sum_out=cp.empty(x.size, cp.float32))
        gc.decode_accumulate(m, cp.zeros(x.size, cp.float32), fmt)
    assert not [r for r in caplog.records if "host" in r.getMessage()], caplog.text
    launched = cp.runtime_state.launches
    assert all(launched.get(k, 0) >= 1 for k in ("gc_ada_keys", "gc_ada_tiers", "gc_ada_enc", "gc_ada_choices",
                                                 "gc_ada_dec")), launched
    # adaptive rows with other tiers keep the reference (through host copies)
    other = replace(f, adaptive=replace(f.adaptive, top="e4m3"))
    assert not cuda_codec.supports(other)


_ASAN_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from tests.emulator import fake_cupy
    cp = fake_cupy.make(asan=True)
    sys.modules["cupy"] = cp
    from giftcomm.cuda import adaptive
    from tests import test_adaptive_gpu_emulated as t
    adaptive._MAX_GRID = 3
    adaptive._RUN_FRAMES = 2
    rng = np.random.default_rng(11)
    for f, n in ((t.FORMATS["ada4"], 1000), (t.SMALL[0], 5 * 8 * 256 + 100), (t._row(4500, 8, 600, 384), 3000)):
        t._check_ops(cp, rng, t._nasty(rng, n, f.default_block()), f, f.name, msg_offset=1)
    print("launches", sum(cp.runtime_state.launches.values()))
""")


def test_adaptive_kernels_clean_under_address_sanitizer():
    """The adaptive kernels built -fsanitize=address,alignment (exact-size allocations): no
    out-of-bounds access, no misaligned word access, the message at an odd address."""
    lib = _libasan()
    assert lib, "libasan not found (g++ -print-file-name=libasan.so)"  # as test_gpu_emulated: g++ ships it
    env = dict(os.environ, LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=23",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _ASAN_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "AddressSanitizer" not in r.stderr, r.stderr[-3000:]
    assert "launches" in r.stdout
