"""The real CUDA kernel bodies on the CPU (marker ``emulated_gpu``): the exact source text the
loader gives NVRTC, built as host C++ against the SIMT shim tests/emulator/simt.h (each CUDA
thread a fiber, warp shuffles and __syncthreads real synchronisation points, CTAs in sequence),
launched by the real giftcomm.cuda.codec through the CuPy stand-in tests/emulator/fake_cupy.py,
and compared with giftcomm.reference bit for bit: every op and format, nearest and stochastic,
the edge tables, grid-stride loops forced to iterate (a 3-CTA grid cap). Every launch's
arguments are checked against the kernel's compiled signature (and those signatures against the
PTX when nvcc is installed); a subset runs again with the kernels built under AddressSanitizer.
Not covered here: the device's own instructions (inline PTX, hardware FP8 cvt) -- the shim
compiles the headers' host branches; tests/test_gpu.py runs the same checks on a GPU.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import ANY_BLOCK_FORMATS, FIXED_BLOCK_FORMATS, OWN_ALGORITHMS, PASS_THROUGH_FORMATS, native_only

from giftcomm.cuda import _loader
from giftcomm.cuda import codec as cuda_codec
from studies.device.edge_cases import edge_vectors, random_vector
from tests.emulator import build, fake_cupy

pytestmark = pytest.mark.emulated_gpu

ROOT = Path(__file__).resolve().parents[1]
SCALED = tuple(native_only(ANY_BLOCK_FORMATS))
PASS = tuple(native_only(PASS_THROUGH_FORMATS))
MX = tuple(native_only(FIXED_BLOCK_FORMATS))
# team path (1..256: team widths 1..32), cta path (257..4096), big two-pass path (> 4096)
EDGE_BLOCKS = (1, 3, 4, 8, 32, 256, 300, 4096, 5000)


def install(monkeypatch: pytest.MonkeyPatch, **kw) -> object:
    """Make a fresh stand-in the ``cupy`` module (and drop the loader's compiled-module caches)."""
    cp = fake_cupy.make(**kw)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setattr(_loader, "_functions", {})
    monkeypatch.setattr(cuda_codec, "_scratch_local", threading.local())  # buffers of an earlier stand-in
    return cp


@pytest.fixture
def cp(monkeypatch):
    return install(monkeypatch)


def _tg():
    import tests.test_gpu as tg  # the GPU test file's checks, run here against the emulator

    return tg


@pytest.mark.parametrize("fmt", SCALED + PASS)
def test_edge_tables(cp, fmt, rng):
    tg = _tg()
    for name, vec in edge_vectors(fmt).items():
        for block in EDGE_BLOCKS:
            for offset in (0, 1):  # offset 1: the unaligned (scalar) kernel variants
                tg._check(cp, vec, fmt, block, rng, f"{fmt} {name} block={block} offset={offset}", offset)


@pytest.mark.parametrize("fmt", SCALED + PASS)
def test_random_lengths_and_blocks(cp, fmt, rng):
    tg = _tg()
    for n in (1, 5, 31, 257, 1023, 4099, 9001):
        for block in (1, 2, 7, 8, 32, 100, 256, 257, 1000, 4096, 4097, 10000):
            x = random_vector(rng, n, spread=30)
            if n > 100:
                x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
                x[n // 3 : n // 3 + 20] *= np.float32(2.0**-120)  # subnormal-range values
            for offset in ((0, 1) if n == 1023 else (0,)):
                tg._check(cp, x, fmt, block, rng, f"{fmt} n={n} block={block} offset={offset}", offset)


@pytest.mark.parametrize("fmt,rounding", [(f, r) for f in MX for r in ("nearest", "stochastic")]
                         + [(f, "stochastic") for f in SCALED])
def test_mx_formats_and_stochastic_rounding(cp, fmt, rounding, rng):
    tg = _tg()
    for name, vec in edge_vectors("e4m3").items():
        tg._check_mx(cp, vec, fmt, rounding, rng, f"{fmt} {rounding} {name}")
    for n in (1, 2, 15, 17, 33, 1023, 1025, 2049, 5000):
        x = random_vector(rng, n, spread=30)
        if n > 100:
            x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
            x[n // 3 : n // 3 + 40] *= np.float32(2.0**-110)
        tg._check_mx(cp, x, fmt, rounding, rng, f"{fmt} {rounding} n={n}")


def _stochastic_blocks(cp, rng, n: int, blocks: tuple[int, ...]) -> None:
    """e4m3/e5m2 stochastic encode and decode-add-encode (+ sum_out) at ``blocks``, x aligned and
    not (the _vec and scalar one-pass kernels; the two-pass path above 4096), vs the reference."""
    from giftcomm import codec as gc
    from giftcomm.reference import codec as ref

    kw = dict(rounding="stochastic", key=0xFEEDFACE12345678, offset=(1 << 32) - 5)
    for fmt in SCALED:
        for block in blocks:
            x = random_vector(rng, n, spread=20)
            want = ref.encode(x, fmt, block, **kw)
            for off in (0, 1):
                xd = cp.zeros(n + off, cp.float32)[off:]
                xd[...] = cp.asarray(x)
                got = cp.asnumpy(gc.encode(xd, fmt, block, **kw))
                assert np.array_equal(got, want), f"{fmt} block={block} x+{off}"
            local = random_vector(rng, n)
            s = cp.full(n, cp.nan, cp.float32)
            got = cp.asnumpy(gc.decode_add_encode(cp.asarray(want), cp.asarray(local), fmt, block, sum_out=s, **kw))
            assert np.array_equal(got, ref.decode_add_encode(want, local, fmt, block, **kw)), f"{fmt} dae block={block}"
            assert np.array_equal(cp.asnumpy(s), ref.decode(want, n, fmt, block) + local), f"{fmt} sum_out block={block}"


def test_stochastic_rounding_every_block_path(cp, rng):
    """e4m3/e5m2 stochastic at blocks on the team (1..256), cta (257..4096) and two-pass (> 4096)
    paths: one pass at block <= 4096, the same bytes as the reference."""
    _stochastic_blocks(cp, rng, n=5001, blocks=(1, 3, 16, 64, 256, 300, 4096, 4097, 9000))


def test_decode_every_access_width(cp, rng):
    """decode / decode_accumulate with the payload 16-byte aligned (vec 2), 4-byte aligned (vec 1)
    and the output misaligned for float4 (vec 0), blocks crossing inside a 16-value group."""
    from giftcomm import codec as gc
    from giftcomm.reference import codec as ref
    from studies.device.edge_cases import floats_equal

    for fmt in SCALED:
        for block in (1, 3, 5, 16, 17, 100, 4097):
            n = 1000 + int(rng.integers(0, 40))
            want = ref.encode(random_vector(rng, n, spread=20), fmt, block)
            dec = ref.decode(want, n, fmt, block)
            for moff in (0, 4, 8):
                store = cp.zeros(want.size + 16, cp.uint8)
                msg = store[moff : moff + want.size]
                msg[...] = cp.asarray(want)
                for ooff in (0, 1, 2):
                    out = cp.zeros(n + ooff, cp.float32)[ooff:]
                    gc.decode(msg, n, fmt, block, out=out)
                    assert floats_equal(cp.asnumpy(out), dec).all(), f"{fmt} block={block} msg+{moff} out+{ooff}"
                    acc0 = random_vector(rng, n)
                    acc = cp.zeros(n + ooff, cp.float32)[ooff:]
                    acc[...] = cp.asarray(acc0)
                    gc.decode_accumulate(msg, acc, fmt, block)
                    assert floats_equal(cp.asnumpy(acc), acc0 + dec).all(), f"acc {fmt} block={block} msg+{moff} out+{ooff}"


# decode-add-encode layouts: (message, out message, local, sum_out) offsets in bytes / bytes /
# floats / floats (sum_out None: not asked). Messages start 4-byte aligned (their scales must).
DAE_LAYOUTS = ((0, 0, 0, 0), (4, 0, 0, 0), (0, 8, 0, None), (0, 0, 1, 0), (0, 0, 0, 2))


def _dae_cases(cp, rng, blocks: tuple[int, ...], layouts=DAE_LAYOUTS, values: int = 4) -> None:
    """e4m3/e5m2 decode-add-encode, nearest and stochastic, at ``blocks`` (about ``values`` scale
    blocks each, the last one partial) for every buffer layout: each access width of the kernels
    (16-byte, 4-byte, single values) on every path (team, cta, two-pass); edge values (NaN, Inf,
    subnormal-range sums, a zero block) in both operands; the bytes and sums vs the reference.
    Block j > 0 has its amax at its last, first or a random value (j % 3), the partial block at
    its last: a reduction that misses the last (or first) lane, warp or tile changes the scale."""
    from giftcomm import codec as gc
    from giftcomm.reference import codec as ref
    from studies.device.edge_cases import floats_equal

    for fmt in SCALED:
        for block in blocks:
            n = max(1, values * block - block // 3)
            x = random_vector(rng, n, spread=25)
            local = random_vector(rng, n, spread=25)
            for j in range(1, -(-n // block)):
                pos = min(j * block + (block - 1, 0, int(rng.integers(0, block)))[j % 3], n - 1)
                x[pos] = np.float32(2.0**40) * np.sign(rng.standard_normal())
            k = rng.integers(0, n, 4)
            x[k[:2]], local[k[2:]] = [np.nan, np.inf], [-np.inf, np.float32(3e38)]
            local[n // 2 : n // 2 + 40] *= np.float32(2.0**-126)  # subnormal-range sums
            if n > block:
                x[:block], local[:block] = 0.0, 0.0  # a zero block
            want = ref.encode(x, fmt, block)
            for rounding in ("nearest", "stochastic"):
                kw = dict(rounding=rounding, key=0x0DDBA11CAFE, offset=(1 << 32) - 7) if rounding == "stochastic" else {}
                with np.errstate(all="ignore"):
                    total = ref.decode(want, n, fmt, block) + local
                    ref_out = ref.decode_add_encode(want, local, fmt, block, **kw)
                for moff, ooff, loff, soff in layouts:
                    msg = cp.zeros(want.size + 16, cp.uint8)[moff : moff + want.size]
                    msg[...] = cp.asarray(want)
                    out = cp.full(want.size + 16, 0xEE, cp.uint8)[ooff : ooff + want.size]
                    loc = cp.zeros(n + 4, cp.float32)[loff : loff + n]
                    loc[...] = cp.asarray(local)
                    s = None if soff is None else cp.full(n + 4, cp.nan, cp.float32)[soff : soff + n]
                    gc.decode_add_encode(msg, loc, fmt, block, out=out, sum_out=s, **kw)
                    label = f"{fmt} {rounding} block={block} n={n} layout={(moff, ooff, loff, soff)}"
                    got = cp.asnumpy(out)
                    bad = np.flatnonzero(got != ref_out)
                    assert not bad.size, f"{label}: {bad.size} bytes differ, first {bad[:4]}"
                    if s is not None:
                        assert floats_equal(cp.asnumpy(s), total).all(), f"{label}: sum_out"


def test_decode_add_encode_every_path_and_width(cp, rng):
    """The ring hop's kernels (16 values per lane) at every block path -- team (1..512: widths 1..32,
    blocks below, at and not multiples of 16), cta (513..8192), two passes (> 8192) -- each with
    16-byte, 4-byte and single-value accesses, nearest and stochastic, with and without sum_out."""
    _dae_cases(cp, rng, (1, 3, 8, 12, 16, 17, 100, 256, 512, 513, 1000, 8192))
    _dae_cases(cp, rng, (8193, 12288), layouts=DAE_LAYOUTS[:4])


MX_LAYOUTS = ((0, 0, 0, 0), (4, 8, 0, 0), (8, 4, 1, 0), (0, 0, 0, 3))


def _mx_cases(cp, rng, n: int, layouts=MX_LAYOUTS) -> None:
    """MX / nvfp4 encode and decode-add-encode of ``n`` values (nearest and stochastic), for each
    (message, out message, x / local, sum_out) offset layout: the kernels' 16- / 8-byte accesses
    where aligned and single values where not; NaN, Inf and subnormal-range sums included."""
    from giftcomm import codec as gc
    from giftcomm.reference import codec as ref
    from studies.device.edge_cases import floats_equal

    for fmt in MX:
        x, local = random_vector(rng, n, spread=20), random_vector(rng, n, spread=20)
        x[[7, n // 3]], local[[40, n // 2]] = np.nan, [np.inf, -np.inf]
        local[n // 3 : n // 3 + 200] *= np.float32(2.0**-120)
        for rounding in ("nearest", "stochastic"):
            kw = dict(rounding=rounding, key=0xC0FFEE, offset=12345) if rounding == "stochastic" else {}
            want = ref.encode(x, fmt, **kw)
            with np.errstate(all="ignore"):
                hop = ref.decode_add_encode(want, local, fmt, **kw)
                total = ref.decode(want, n, fmt) + local
            for moff, ooff, loff, soff in layouts:
                xd = cp.zeros(n + 4, cp.float32)[loff : loff + n]
                xd[...] = cp.asarray(x)
                out = cp.full(want.size + 16, 0xEE, cp.uint8)[ooff : ooff + want.size]
                gc.encode(xd, fmt, out=out, **kw)
                label = f"{fmt} {rounding} n={n} layout={(moff, ooff, loff, soff)}"
                assert np.array_equal(cp.asnumpy(out), want), f"{label}: encode"
                msg = cp.zeros(want.size + 16, cp.uint8)[moff : moff + want.size]
                msg[...] = cp.asarray(want)
                xd[...] = cp.asarray(local)
                s = cp.full(n + 4, cp.nan, cp.float32)[soff : soff + n]
                gc.decode_add_encode(msg, xd, fmt, out=out, sum_out=s, **kw)
                assert np.array_equal(cp.asnumpy(out), hop), f"{label}: decode_add_encode"
                assert floats_equal(cp.asnumpy(s), total).all(), f"{label}: sum_out"


def test_mx_encode_and_hop_every_access_width(cp, rng):
    """MX / nvfp4 encode and decode-add-encode with x, local, sum_out and the messages aligned for
    the 16- / 8-byte accesses and not (a partial last block and group): bytes and sums vs the reference."""
    _mx_cases(cp, rng, 3 * 1024 + int(rng.integers(1, 40)))


def test_mx_decode_aligned_and_not(cp, rng):
    """MX / nvfp4 decode and accumulate with float4 stores (out 16-byte aligned) and without."""
    from giftcomm import codec as gc
    from giftcomm.reference import codec as ref
    from studies.device.edge_cases import floats_equal

    for fmt in MX:
        n = 2048 + int(rng.integers(1, 40))
        x = random_vector(rng, n, spread=20)
        x[5] = np.nan
        want = ref.encode(x, fmt)
        dec = ref.decode(want, n, fmt)
        msg = cp.asarray(want)
        for ooff in (0, 1, 3):
            out = cp.zeros(n + ooff, cp.float32)[ooff:]
            gc.decode(msg, n, fmt, out=out)
            assert floats_equal(cp.asnumpy(out), dec).all(), f"{fmt} out+{ooff}"
            acc0 = random_vector(rng, n)
            acc = cp.zeros(n + ooff, cp.float32)[ooff:]
            acc[...] = cp.asarray(acc0)
            gc.decode_accumulate(msg, acc, fmt)
            assert floats_equal(cp.asnumpy(acc), acc0 + dec).all(), f"acc {fmt} out+{ooff}"


def _one_of_everything(cp, rng, n: int = 6001) -> None:
    """One small case of every op x format x kernel path (aligned and not), ``n`` values."""
    tg = _tg()
    for fmt in SCALED + PASS:
        for block in (7, 16, 301, 300, 5000):  # odd blocks: the scalar (non-_vec) variants
            x = random_vector(rng, n, spread=10)
            for offset in (0, 1):
                tg._check(cp, x, fmt, block, rng, f"{fmt} block={block} offset={offset}", offset)
    for fmt in MX:
        for rounding in ("nearest", "stochastic"):
            tg._check_mx(cp, random_vector(rng, 3000, spread=10), fmt, rounding, rng, f"{fmt} {rounding}")
    _stochastic_blocks(cp, rng, n=3001, blocks=(7, 16, 301, 300, 5000))
    # decode-add-encode on each path, enough scale blocks that a 3-CTA grid iterates (team path:
    # 256 / G teams per CTA), 16-byte, 4-byte (no sum_out) and single-value accesses
    for block, values in ((16, 800), (300, 30), (600, 5), (8200, 2)):
        _dae_cases(cp, rng, (block,), layouts=((0, 0, 0, 0), (4, 0, 0, None), (0, 0, 1, 2)), values=values)
    # MX / nvfp4 encode and hop: 128 MX blocks / 8 nvfp4 groups per CTA, so 25,000 values iterate a 3-CTA grid
    _mx_cases(cp, rng, 25_000 + int(rng.integers(1, 40)), layouts=MX_LAYOUTS[::2])
    from tests import test_adaptive_gpu_emulated as ada  # the adaptive rows (gc_ada_*), every op

    ada._check_ops(cp, rng, ada._nasty(rng, 2 * 8 * 256 + 700, 256), ada.SMALL[0], "adaptive", msg_offset=1)
    x = random_vector(rng, 1001, spread=10)
    x[:50] = np.float32(np.finfo(np.float32).tiny) * np.float32(0.75)  # subnormal inputs and quotients
    d = cp.asarray(x)
    cuda_codec.divide_inplace(d, 3.0)
    assert np.array_equal(cp.asnumpy(d).view(np.uint32), (x / np.float32(3)).view(np.uint32))
    wide = cuda_codec.convert(cp.asarray(x), np.float64)  # float32 <-> float64 of the collectives
    assert np.array_equal(cp.asnumpy(wide), x.astype(np.float64))
    x64 = x.astype(np.float64) * (1 + 2.0**-30) / 3
    assert np.array_equal(cp.asnumpy(cuda_codec.convert(cp.asarray(x64), np.float32)).view(np.uint32),
                          x64.astype(np.float32).view(np.uint32))
    y = random_vector(rng, x.size)
    assert np.array_equal(cp.asnumpy(cuda_codec.add(cp.asarray(x), cp.asarray(y))).view(np.uint32), (x + y).view(np.uint32))
    acc = cp.asarray(y)
    cuda_codec.add_inplace(acc, cp.asarray(x))
    assert np.array_equal(cp.asnumpy(acc).view(np.uint32), (y + x).view(np.uint32))


def test_grid_stride_loops_iterate(monkeypatch, rng):
    """A 3-CTA grid cap (the launch code's own _MAX_GRID): every grid-stride loop runs several
    rounds per CTA, so a wrong stride or a missing barrier between rounds shows."""
    cp = install(monkeypatch)
    monkeypatch.setattr(cuda_codec, "_MAX_GRID", 3)
    _one_of_everything(cp, rng)
    assert max(cp.runtime_state.launches.values()) > 0


def test_every_kernel_launched_with_checked_arguments(cp, rng):
    """Every kernel the module defines is launched by giftcomm.cuda.codec, each launch's argument
    count and types matching the kernel's compiled signature (fake_cupy.RawKernel refuses
    anything else)."""
    _one_of_everything(cp, rng)
    kernels = set(build.build(_loader.source_text("codec")).kernels)
    launched = set(cp.runtime_state.launches)
    assert kernels - launched == set(), f"never launched: {sorted(kernels - launched)}"
    assert launched <= kernels


def test_launch_checks_refuse_wrong_arguments(cp):
    x = cp.zeros(16, cp.float32)
    fn = _loader.get_function("gc_div_f32")
    fn((1,), (256,), (x, np.float32(2), np.int64(16)))
    with pytest.raises(TypeError, match="i64 needs numpy.int64"):
        fn((1,), (256,), (x, np.float32(2), 16))  # a Python int: CuPy would pass 8 bytes of int64 anyway, but say so
    with pytest.raises(TypeError, match="f32\\* needs a float32 array"):
        fn((1,), (256,), (x.view(cp.uint32), np.float32(2), np.int64(16)))
    with pytest.raises(TypeError, match="3 parameters"):
        fn((1,), (256,), (x, np.float32(2)))
    with pytest.raises(TypeError, match="device array"):
        fn((1,), (256,), (np.zeros(16, np.float32), np.float32(2), np.int64(16)))
    with pytest.raises(ValueError, match="launch_bounds"):
        fn((1,), (512,), (x, np.float32(2), np.int64(16)))


_BAD_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(64) past_end(float* x, long long n) {
    if (threadIdx.x == 0) x[n] = 1.0f;  // one past the end
}
extern "C" __global__ void __launch_bounds__(64) read_past_end(const float* x, float* y, long long n) {
    if (threadIdx.x == 0) y[0] = x[n + 1];
}
extern "C" __global__ void __launch_bounds__(64) bad_mask(float* x) {
    unsigned v = threadIdx.x;
    v = __shfl_xor_sync(0x0000FFFFu, v, 16);  // lanes 16..31 are not in the mask
    x[threadIdx.x] = (float)v;
}
extern "C" __global__ void __launch_bounds__(64) mask_misses_partner(float* x) {
    unsigned v = threadIdx.x;
    if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0x0000FFFFu, v, 16);  // partner lane 16+ outside
    x[threadIdx.x] = (float)v;
}
extern "C" __global__ void __launch_bounds__(64) team_sum(unsigned* out) {
    unsigned v = threadIdx.x;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    __syncthreads();
    out[threadIdx.x] = v;
}
"""


def test_shim_reports_what_hardware_leaves_undefined(cp):
    mod = cp.RawModule(code=_BAD_SOURCE)
    x = cp.zeros(64, cp.float32)
    with pytest.raises(RuntimeError, match="out-of-bounds write after"):
        mod.get_function("past_end")((1,), (64,), (cp.zeros(8, cp.float32), np.int64(8)))
    with pytest.raises(RuntimeError, match="not in the member mask"):
        mod.get_function("bad_mask")((1,), (32,), (x,))
    with pytest.raises(RuntimeError, match="source lane not in the member mask"):
        mod.get_function("mask_misses_partner")((1,), (32,), (x,))
    out = cp.zeros(64, cp.uint32)
    mod.get_function("team_sum")((2,), (64,), (out,))
    got = cp.asnumpy(out)
    assert (got[:32] == sum(range(32))).all() and (got[32:] == sum(range(32, 64))).all()


# ---------------------------------------------------------------- AddressSanitizer
_ASAN_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from tests.emulator import fake_cupy
    cp = fake_cupy.make(asan=True)
    sys.modules["cupy"] = cp
    from tests import test_gpu_emulated as t
    rng = np.random.default_rng(7)
    if sys.argv[1] == "suite":
        from giftcomm.cuda import codec
        codec._MAX_GRID = 3
        t._one_of_everything(cp, rng, n=2500)
        print("launches", sum(cp.runtime_state.launches.values()), "kernels", len(cp.runtime_state.launches))
    else:  # negative control: a read one past the end must be reported
        mod = cp.RawModule(code=t._BAD_SOURCE)
        x = cp.zeros(8, cp.float32)
        mod.get_function("read_past_end")((1,), (32,), (x, x, np.int64(8)))
""")


def _libasan() -> str | None:
    cxx = build.CXX
    if shutil.which(cxx) is None:
        return None
    p = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return p if p and os.path.isabs(p) and os.path.exists(p) else None


def _run_asan(mode: str) -> subprocess.CompletedProcess:
    lib = _libasan()
    assert lib, "libasan not found (g++ -print-file-name=libasan.so)"
    env = dict(os.environ, LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=23",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", _ASAN_SCRIPT, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_kernels_clean_under_address_sanitizer():
    """Every kernel path (3-CTA grid) with the kernels built -fsanitize=address,alignment: no
    out-of-bounds access and no vector or word access at an address not aligned for it (a fault on
    the GPU); and a planted read past the end is reported (the sanitizer is really on)."""
    r = _run_asan("suite")
    assert r.returncode == 0 and "AddressSanitizer" not in r.stderr, r.stderr[-3000:]
    assert "launches" in r.stdout
    bad = _run_asan("control")
    assert bad.returncode == 23 and "heap-buffer-overflow" in bad.stderr, (bad.returncode, bad.stderr[-2000:])


# ---------------------------------------------------------------- signatures against the PTX
_PTX_TYPES = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}
_SIZES = {"f32": 4, "f64": 8, "u8": 1, "i8": 1, "u16": 2, "i16": 2, "u32": 4, "i32": 4, "u64": 8, "i64": 8}


def _nvcc() -> str | None:
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed: the launch checks use the host-compiled signatures")
def test_host_signatures_match_the_ptx(tmp_path):
    """The parameter list the emulator checks launches against (from the host compiler) equals
    the one nvcc compiles for the device: per kernel the same count and sizes, pointers 8 bytes."""
    src = tmp_path / "codec.cu"
    src.write_text(_loader.source_text("codec"))
    ptx = tmp_path / "codec.ptx"
    subprocess.run([_nvcc(), "-ptx", "-std=c++17", "-arch=sm_90", str(src), "-o", str(ptx)], check=True,
                   capture_output=True)
    text = ptx.read_text()
    entries = {m.group(1): re.findall(r"\.param\s+\.(\w+)\s+\w+", m.group(2))
               for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", text)}
    host = build.build(_loader.source_text("codec")).kernels
    assert set(entries) == set(host)
    for name, (sig, _bound) in host.items():
        want = [8 if p.endswith("*") else _SIZES[p] for p in sig.split(",")]
        got = [_PTX_TYPES[t] for t in entries[name]]
        assert got == want, f"{name}: PTX params {entries[name]} vs host {sig}"


# ---------------------------------------------------------------- collectives under -ftz=true
# The stand-in with ftz=True flushes float32 subnormals in every CuPy-style elementwise operation
# and float32<->float64 cast, as CuPy's own kernels do on a GPU; the codec kernels do not (the
# shim runs them with IEEE arithmetic, which the PTX check in tests/test_gpu_plumbing.py ties to
# the device code). So a collective equals the NumPy simulation on subnormal-heavy data only if
# every float operation it does on device arrays goes through giftcomm's kernels.
FTZ_ALGORITHMS = OWN_ALGORITHMS
FTZ_CASES = [("fp32", 8), ("e4m3", 32), ("e5m2", 256), ("bf16", 64), ("mxfp8", None), ("nvfp4", None)]


def subnormal_heavy(rng, p: int, n: int, dtype) -> list[np.ndarray]:
    """Per-rank values of magnitude 2^-150..2^-100: float32 subnormals, their sums, and block
    scales whose decoded values are subnormal (studies.device.matrix.data)."""
    from studies.device import matrix

    return matrix.data(rng, p, n, dtype, "subnormal")


@pytest.mark.parametrize("algorithm", FTZ_ALGORITHMS)
def test_collectives_keep_subnormals_under_ftz(monkeypatch, rng, algorithm):
    from studies.device import matrix

    cp = install(monkeypatch, ftz=True)
    for fmt, block in FTZ_CASES:
        for dtype in (np.float32, np.float64):
            for p in (1, 3, 4):
                op = ("sum", "avg")[p % 2]
                why = matrix.allreduce_case(cp, rng, p, algorithm, fmt, dtype, op, kind="subnormal", block=block)
                assert why is None, f"{algorithm} {fmt} {np.dtype(dtype).name} {op} P={p}: {why}"
    for fmt in ("e4m3", "mxfp4"):  # stochastic rounding: the same float path, other random bits
        why = matrix.allreduce_case(cp, rng, 3, algorithm, fmt, np.float64, "avg", rounding="stochastic", kind="subnormal")
        assert why is None, f"{algorithm} {fmt} stochastic: {why}"


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_reduce_scatter_keeps_subnormals_under_ftz(monkeypatch, rng, algorithm):
    import giftcomm as gc
    from giftcomm.reference import simulate_reduce_scatter
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    cp = install(monkeypatch, ftz=True)
    for fmt, block in FTZ_CASES[:4]:
        for dtype in (np.float32, np.float64):
            p, op = 3, "avg" if dtype == np.float32 else "sum"
            xs = subnormal_heavy(rng, p, 999, dtype)
            args = [cp.asarray(x) for x in xs]
            got = DeviceLoopbackGroup(p).run(lambda t: gc.reduce_scatter(args[t.rank], comm=t, op=op, fmt=fmt,
                                                                         block=block, algorithm=algorithm))
            want = simulate_reduce_scatter(xs, fmt, block, op, algorithm)
            for r in range(p):
                g = cp.asnumpy(got[r])
                assert g.tobytes() == want[r].tobytes(), f"{algorithm} {fmt} {np.dtype(dtype).name} rank {r}"


def test_ftz_stand_in_flushes_like_cupy(monkeypatch):
    """The stand-in really flushes (else the test above could not fail): float32 adds, casts."""
    cp = install(monkeypatch, ftz=True)
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    a = cp.asarray(np.array([tiny, -tiny * 3, 1.0], np.float32))
    assert cp.asnumpy(a + a).tolist()[:2] == [0.0, 0.0]
    assert cp.asnumpy(a.astype(np.float64))[0] == 0.0
    b = cp.asarray(np.array([1e-40, 1.0], np.float64)).astype(np.float32)
    assert cp.asnumpy(b)[0] == 0.0


# ---------------------------------------------------------------- DLPack, alignment, allocations
def test_jax_bfloat16_device_arrays_go_as_uint16_bits(monkeypatch, rng):
    """A JAX bfloat16 array on the device reaches CuPy as uint16 bits (a JAX-side bitcast): CuPy 13
    refuses bfloat16 DLPack, which the stand-in mimics. A JAX CPU array stands in for a GPU one."""
    from jax import numpy as jnp

    from giftcomm import _xp

    cp = install(monkeypatch)
    monkeypatch.setattr(_xp, "is_device_array", lambda x: not isinstance(x, np.ndarray))
    host = rng.standard_normal(37).astype(np.float32)
    x = jnp.asarray(host, jnp.bfloat16)
    imp = _xp.import_array(x)
    assert imp.device and imp.logical == "bfloat16" and imp.source == "jax"
    assert isinstance(imp.array, cp.ndarray) and imp.array.dtype == np.uint16
    assert np.array_equal(cp.asnumpy(imp.array), np.asarray(x).view(np.uint16))
    f32 = cp.asnumpy(_xp.to_float32(imp.array, "bfloat16"))
    assert np.array_equal(f32, np.asarray(x).astype(np.float32))


def test_misaligned_arguments_raise_value_error(cp):
    """A misaligned fp32 message or float32 array is a ValueError before any launch (on a GPU a
    misaligned float access is a sticky fault of the context)."""
    from giftcomm import codec as gc

    x = cp.asarray(np.arange(8, dtype=np.float32))
    store = cp.zeros(4 * 8 + 4, cp.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        gc.encode(x, "fp32", out=store[1 : 1 + 32])
    good = gc.encode(x, "fp32", out=store[4 : 4 + 32])
    shifted = cp.zeros(4 * 8 + 4, cp.uint8)
    shifted[1 : 1 + 32] = good
    with pytest.raises(ValueError, match="4-byte aligned"):
        gc.decode(shifted[1 : 1 + 32], 8, "fp32")
    odd = cp.zeros(40, cp.uint8)[2 : 2 + 32].view(cp.float32)
    with pytest.raises(ValueError, match="4-byte aligned"):
        gc.encode(odd, "e4m3")
    assert np.array_equal(cp.asnumpy(gc.decode(good, 8, "fp32")), np.arange(8, dtype=np.float32))


@pytest.mark.parametrize("fmt,block,rounding", [("e4m3", 16384, "nearest"), ("e5m2", 5000, "nearest"),
                                                ("e4m3", 64, "stochastic"), ("e5m2", 9000, "stochastic"),
                                                ("nvfp4", None, "stochastic"), ("fp32", None, "nearest")])
def test_no_allocation_in_a_calls_steady_state(cp, rng, fmt, block, rounding):
    """With out= / sum_out= given, repeated codec calls allocate no device memory after the first
    (the big path's amax scratch is reused): what CUDA-graph capture needs."""
    from giftcomm import codec as gc

    n = 9_001
    x, local = cp.asarray(random_vector(rng, n)), cp.asarray(random_vector(rng, n))
    kw = dict(rounding=rounding, key=12345) if rounding == "stochastic" else {}
    msg = gc.encode(x, fmt, block, **kw)
    out, dec, s = cp.empty(msg.size, cp.uint8), cp.empty(n, cp.float32), cp.empty(n, cp.float32)

    def calls():
        gc.encode(x, fmt, block, out=out, **kw)
        gc.decode(msg, n, fmt, block, out=dec)
        gc.decode_add_encode(msg, local, fmt, block, out=out, sum_out=s, **kw)
        gc.decode_accumulate(msg, dec, fmt, block)

    calls()
    before = cp.runtime_state.allocations
    for _ in range(3):
        calls()
    assert cp.runtime_state.allocations == before


def test_device_benchmark_codec_section_runs_on_the_stand_in(monkeypatch, rng):
    """``python -m giftcomm.perf device``'s codec section (perf/device_check.sh step 7) on the
    stand-in, every case with a dummy timer: each (format, block, op) of the default tables is
    called and reaches every decode-add-encode kernel path, nearest and stochastic, and the MX /
    nvfp4 kernels, so the benchmark measures the kernels the tests above check."""
    from types import SimpleNamespace

    from giftcomm.perf import device_bench as db

    cp = install(monkeypatch)
    monkeypatch.setattr(cp, "random", SimpleNamespace(
        standard_normal=lambda n, dtype: cp.asarray(rng.standard_normal(n).astype(dtype))), raising=False)
    a = db.parse_args([])
    cases = db.codec_cases(a.formats, a.blocks)
    seen: list[int] = []
    res = db.measure_codec(cp, lambda fn: (fn(), 1.0)[1], 600, cases, on_case=lambda r: seen.append(len(r)))
    assert set(res) == {(f, b, op) for f, b in cases for op in db.OPS} and seen[-1] == len(res)
    launched = set(cp.runtime_state.launches)
    for f in SCALED:
        for kernel in ("team", "cta", "big"):
            assert {f"gc_dae_{kernel}_{f}", f"gc_dae_{kernel}_sr_{f}"} <= launched
        assert {f"gc_enc_big_sr_{f}", f"gc_enc_team_sr_vec_{f}", f"gc_acc_{f}"} <= launched
    assert {f"gc_mx_{op}_{f}" for op in ("enc", "dec") for f in MX} <= launched


def test_device_matrix_script_runs_on_the_stand_in(monkeypatch, rng):
    """studies/device/matrix.py (perf/device_check.sh's collectives and plans sections) on the
    stand-in with -ftz=true arithmetic: a small part of its matrix, so that the script is known to
    work before it reaches a GPU."""
    from studies.device import matrix

    cp = install(monkeypatch, ftz=True)
    lines: list[str] = []
    res = matrix.collectives(cp, rng, True, lines.append, formats=("e4m3", "nvfp4", "fp32"),
                             algorithms=("ring", "doubling"))
    assert res["cases"] == 2 * (2 * 2 * 2 * 2 + 2 * 2) and not res["failures"], lines
    res = matrix.plans(cp, rng, True, lines.append)
    assert res["cases"] == 27 and not res["failures"], lines
