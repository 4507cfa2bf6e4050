"""The real GPU tests: CUDA kernels (through giftcomm.codec's public functions on CuPy arrays) vs
giftcomm.reference.codec bit for bit, DLPack with torch CUDA, the transform plan, NCCL at one
rank, and the public collectives on torch CUDA bfloat16 tensors. The collectives on CuPy arrays
over the grouped schedule, every algorithm, are the "cupy" path of tests/test_collectives.py,
which runs wherever this file does.

They skip (reason "no CUDA GPU") only when no CUDA device is usable; everything else fails.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import ANY_BLOCK_FORMATS, FIXED_BLOCK_FORMATS, PASS_THROUGH_FORMATS, native_only

import giftcomm.cuda
from giftcomm.cuda import _loader
from giftcomm.reference import codec as ref
from giftcomm.reference import simulate_allreduce
from studies.device.edge_cases import BLOCKS, LENGTHS, edge_vectors, floats_equal, messages_equal, random_vector

pytestmark = pytest.mark.skipif(not giftcomm.cuda.available(), reason="no CUDA GPU")

SCALED = tuple(native_only(ANY_BLOCK_FORMATS))
PASS_FORMATS = tuple(native_only(PASS_THROUGH_FORMATS))
FORMATS = SCALED + PASS_FORMATS


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def _check(cp, x, fmt, block, rng, label, offset=0):
    """Every codec op on the GPU against the reference; ``offset`` shifts the device buffers by
    that many elements/bytes, to run the unaligned (scalar) kernel variants."""
    from giftcomm import codec as gc

    n = x.size
    with np.errstate(all="ignore"):
        want = ref.encode(x, fmt, block)
        xd = cp.zeros(n + offset, cp.float32)[offset:]
        xd[...] = cp.asarray(x)
        msg_store = cp.full(want.size + 4 * offset, 0xEE, cp.uint8)
        msg = msg_store[4 * offset : 4 * offset + want.size]
        gc.encode(xd, fmt, block, out=msg)
        ok, why = messages_equal(cp.asnumpy(msg), want, n, fmt, block)
        assert ok, f"{label}: encode: {why}"
        dmsg = cp.asarray(want)
        dec = gc.decode(dmsg, n, fmt, block)
        assert floats_equal(cp.asnumpy(dec), ref.decode(want, n, fmt, block)).all(), f"{label}: decode"
        acc0 = random_vector(rng, n)
        acc = cp.asarray(acc0)
        gc.decode_accumulate(dmsg, acc, fmt, block)
        assert floats_equal(cp.asnumpy(acc), acc0 + ref.decode(want, n, fmt, block)).all(), f"{label}: accumulate"
        local = random_vector(rng, n)
        s = cp.full(n, cp.nan, cp.float32)
        out = gc.decode_add_encode(dmsg, cp.asarray(local), fmt, block, sum_out=s)
        total = ref.decode(want, n, fmt, block) + local
        ok, why = messages_equal(cp.asnumpy(out), ref.encode(total, fmt, block), n, fmt, block)
        assert ok, f"{label}: decode_add_encode: {why}"
        assert floats_equal(cp.asnumpy(s), total).all(), f"{label}: sum_out"


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_edge_tables(cp, fmt, rng):
    for name, vec in edge_vectors(fmt).items():
        for block in (1, 3, 4, 8, 256, 300, 5000):
            for offset in (0, 1):
                _check(cp, vec, fmt, block, rng, f"{fmt} {name} block={block} offset={offset}", offset)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_random(cp, fmt, rng):
    for n in LENGTHS + (100_003, 1 << 20):
        for block in BLOCKS + (1 << 20,):
            x = random_vector(rng, n, spread=30)
            if n > 100:
                x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
            _check(cp, x, fmt, block, rng, f"{fmt} n={n} block={block}")


MX_FORMATS = tuple(native_only(FIXED_BLOCK_FORMATS))


def _check_mx(cp, x, fmt, rounding, rng, label):
    """The new formats (own block) and stochastic rounding, every op, against the reference."""
    from giftcomm import codec as gc

    n = x.size
    kw = dict(rounding=rounding, key=0x0123456789ABCDEF, offset=(1 << 32) - 3)
    with np.errstate(all="ignore"):
        want = ref.encode(x, fmt, **kw)
        got = cp.asnumpy(gc.encode(cp.asarray(x), fmt, **kw))
        assert np.array_equal(got, want), f"{label}: encode bytes {np.flatnonzero(got != want)[:8]}"
        dmsg = cp.asarray(want)
        assert floats_equal(cp.asnumpy(gc.decode(dmsg, n, fmt)), ref.decode(want, n, fmt)).all(), f"{label}: decode"
        acc0 = random_vector(rng, n)
        acc = cp.asarray(acc0)
        gc.decode_accumulate(dmsg, acc, fmt)
        assert floats_equal(cp.asnumpy(acc), acc0 + ref.decode(want, n, fmt)).all(), f"{label}: accumulate"
        local = random_vector(rng, n)
        s = cp.full(n, cp.nan, cp.float32)
        out = cp.asnumpy(gc.decode_add_encode(dmsg, cp.asarray(local), fmt, sum_out=s, **kw))
        assert np.array_equal(out, ref.decode_add_encode(want, local, fmt, **kw)), f"{label}: decode_add_encode"
        assert floats_equal(cp.asnumpy(s), ref.decode(want, n, fmt) + local).all(), f"{label}: sum_out"


# nearest e4m3/e5m2 are test_kernels_edge_tables / test_kernels_random
@pytest.mark.parametrize("fmt,rounding", [(f, r) for f in MX_FORMATS + SCALED for r in ("nearest", "stochastic")
                                          if not (f in SCALED and r == "nearest")])
def test_kernels_mx_formats_and_stochastic_rounding(cp, fmt, rounding, rng):
    for name, vec in edge_vectors("e4m3").items():
        _check_mx(cp, vec, fmt, rounding, rng, f"{fmt} {rounding} {name}")
    for n in (1, 2, 15, 17, 33, 1023, 1025, 5000, 100_003, 1 << 20):
        x = random_vector(rng, n, spread=30)
        if n > 100:
            x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
            x[n // 3 : n // 3 + 40] *= np.float32(2.0**-110)
        _check_mx(cp, x, fmt, rounding, rng, f"{fmt} {rounding} n={n}")


def test_kernels_decode_add_encode_and_mx_every_path_and_width(cp, rng):
    """The emulated suite's layout tables on the device (tests/test_gpu_emulated.py): the ring hop's
    e4m3/e5m2 kernels on every path (team, cta, two-pass) with 16-byte, 4-byte and single-value
    accesses, nearest and stochastic; MX / nvfp4 encode and hop aligned and not. On a GPU a
    misaligned vector access is a fault, so this is where the host's choice of width is proven."""
    from tests import test_gpu_emulated as emu

    emu._dae_cases(cp, rng, (1, 3, 8, 12, 16, 17, 100, 256, 512, 513, 1000, 8192, 8193, 12288, 65536))
    emu._mx_cases(cp, rng, 3 * 1024 + 17)
    emu._mx_cases(cp, rng, 100_003, layouts=emu.MX_LAYOUTS[:2])


def test_kernels_reject_bad_arguments(cp):
    from giftcomm import codec as gc

    x = cp.ones(10, cp.float32)
    with pytest.raises(ValueError):
        gc.encode(x, "e4m3", 4, out=cp.empty(3, cp.uint8))
    with pytest.raises(TypeError, match="backend"):
        gc.encode(x, "e4m3", 4, out=np.empty(gc.message_nbytes(10, "e4m3", 4), np.uint8))
    msg = gc.encode(x, "e4m3", 4)
    with pytest.raises(ValueError, match="overlap"):
        gc.decode_add_encode(msg, x, "e4m3", 4, out=msg)


def test_dlpack_torch_cuda_zero_copy(cp):
    import torch
    if not torch.cuda.is_available():
        pytest.fail("CuPy sees a GPU but torch does not")
    from giftcomm import _xp

    for tdt in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.arange(16, dtype=tdt, device="cuda")
        imp = _xp.import_array(t)
        assert imp.device and _xp.device_pointer(imp.array) == t.data_ptr()
        f32 = _xp.to_float32(imp.array, imp.logical)
        assert cp.asnumpy(f32).tolist() == list(range(16))
        back = _xp.export_like(_xp.from_float32(f32 * 2, imp.logical), imp)
        assert back.dtype == tdt and back.is_cuda and torch.equal(back, t * 2)


def test_transform_plan_gpu_matches_cpu(cp, rng):
    from giftcomm.geometry.dense_plan import SegmentPair, TransformPlan

    pairs = [SegmentPair(0, 128, 96, np.eye(128, dtype=np.float32) + rng.standard_normal((128, 128)).astype(np.float32) / 12,
                         np.eye(96, dtype=np.float32) + rng.standard_normal((96, 96)).astype(np.float32) / 10)]
    x = rng.standard_normal(128 * 96 + 5).astype(np.float32)
    cpu = TransformPlan(x.size, pairs).forward(x)
    gpu = cp.asnumpy(TransformPlan(x.size, pairs, xp=cp).forward(cp.asarray(x)))
    assert np.linalg.norm(gpu - cpu) / np.linalg.norm(cpu) < 1e-5


def test_nccl_single_rank_sendrecv(cp):
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.fail("NCCL is not available to CuPy on this GPU machine")
    import giftcomm as gc
    from giftcomm.transport.nccl import NcclTransport

    t = NcclTransport(nccl.get_unique_id(), 0, 1)
    a = cp.arange(1000, dtype=cp.uint8)
    b = cp.zeros(1000, cp.uint8)
    t.sendrecv(a, 0, b, 0)
    cp.cuda.get_current_stream().synchronize()
    assert (b == a).all()
    x = cp.asarray(random_vector(np.random.default_rng(0), 3000))
    got = cp.asnumpy(gc.allreduce(x, comm=t, algorithm="ring"))
    assert floats_equal(got, simulate_allreduce([cp.asnumpy(x)], "e4m3", 256, algorithm="ring")[0]).all()
    t.free()


# NVRTC (CuPy's run-time compiler): part of the GPU stack; on machines without a GPU the same
# sources are compiled by nvcc in native/check_cuda.sh (CI).
def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception as exc:  # on a GPU machine CuPy and libnvrtc must be there
        raise AssertionError(f"NVRTC not loadable on a GPU machine ({exc!r})") from exc


def _kernel_names_used_by_codec() -> set[str]:
    names = set()
    for f in SCALED:
        for path in ("team", "cta"):
            for variant in ("_", "_vec_", "_sr_", "_sr_vec_"):
                names.add(f"gc_enc_{path}{variant}{f}")
        for path in ("team", "cta", "big"):
            names |= {f"gc_dae_{path}_{f}", f"gc_dae_{path}_sr_{f}"}
        names |= {f"gc_enc_amax_{f}", f"gc_enc_big_{f}", f"gc_enc_big_sr_{f}", f"gc_dae_amax_{f}", f"gc_dec_{f}", f"gc_acc_{f}"}
    for f in MX_FORMATS:
        names |= {f"gc_mx_enc_{f}", f"gc_mx_dec_{f}"}
    return names | {f"gc_pt_{f}" for f in PASS_FORMATS} | {"gc_div_f32", "gc_cvt_f32_f64", "gc_cvt_f64_f32"}


@pytest.mark.parametrize("arch", ["80", "90"])
def test_nvrtc_compiles_every_kernel(arch):
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(_loader.source_text("codec"), "gc_codec.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(_loader.NVRTC_OPTIONS) + [f"--gpu-architecture=compute_{arch}"])
        ptx = nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)
    entries = {line.split()[2].split("(")[0] for line in ptx.splitlines() if line.startswith(".visible .entry")}
    assert _kernel_names_used_by_codec() <= entries
    assert "fma.rn.f32" not in ptx  # no contraction anywhere
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == (arch == "90")


@pytest.mark.parametrize("arch", ["80", "90"])
def test_nvrtc_ftz_true_changes_nothing(arch):
    """CuPy may append -ftz=true to RawModule options: the codec's PTX must have
    no flush-to-zero instruction even then (gc_add / gc_mul / gc_div are explicit non-.ftz PTX)."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(_loader.source_text("codec"), "gc_codec.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(_loader.NVRTC_OPTIONS) + ["--ftz=true", f"--gpu-architecture=compute_{arch}"])
        ptx = nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)
    flushed = sorted({ln.split()[0] for ln in ptx.splitlines() if ln.split() and ".ftz" in ln.split()[0]})
    assert not flushed, flushed


def test_fp32_subnormal_sums_kept(cp):
    """The 2026-11-30 H200 failure: fp32 pass-through 0 + 5.877472e-39 flushed to 0 by cupy.add."""
    from giftcomm import codec as gc

    sub = np.array([5.877472e-39, -1e-45, 1e-40, 0.0] * 5, np.float32)
    msg = cp.asarray(sub.view(np.uint8))
    acc = cp.zeros(sub.size, cp.float32)
    gc.decode_accumulate(msg, acc, "fp32")
    assert np.array_equal(cp.asnumpy(acc).view(np.uint32), sub.view(np.uint32))
    s = cp.full(sub.size, cp.nan, cp.float32)
    out = gc.decode_add_encode(msg, cp.zeros(sub.size, cp.float32), "fp32", sum_out=s)
    assert np.array_equal(cp.asnumpy(out), sub.view(np.uint8))
    assert np.array_equal(cp.asnumpy(s).view(np.uint32), sub.view(np.uint32))


def test_divide_inplace_keeps_subnormals(cp, rng):
    from giftcomm.cuda.codec import divide_inplace

    x = np.concatenate([random_vector(rng, 10_001, spread=40),
                        np.array([5.877472e-39, 1e-45, 3e-38, -1.2e-38, np.inf, np.nan, -0.0], np.float32)])
    for d in (2, 3, 8):
        got = cp.asnumpy(divide_inplace(cp.asarray(x), d))
        assert floats_equal(got, x / np.float32(d)).all(), d


def test_nvrtc_errors_point_at_the_file(tmp_path, monkeypatch):
    nvrtc = _nvrtc()
    (tmp_path / "bad.cuh").write_text("#pragma once\n// line 2\nint broken = ;\n")
    (tmp_path / "bad.cu").write_text('// one\n#include "bad.cuh"\nextern "C" __global__ void k() {}\n')
    monkeypatch.setattr(_loader, "KERNEL_DIR", tmp_path)
    monkeypatch.setitem(_loader.MODULES, "bad", "bad.cu")
    prog = nvrtc.createProgram(_loader.source_text("bad"), "bad.cu", [], [])
    try:
        with pytest.raises(Exception):
            nvrtc.compileProgram(prog, list(_loader.NVRTC_OPTIONS))
        log = nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)
    assert f"{tmp_path / 'bad.cuh'}(3)" in log


# ------------------------------------------------- the device path of the public collectives
def test_public_collectives_on_torch_cuda_bf16(cp):
    """torch CUDA bfloat16 tensors in, torch bfloat16 tensors out (DLPack, uint16 bits inside)."""
    import torch
    if not torch.cuda.is_available():
        pytest.fail("CuPy sees a GPU but torch does not")
    import ml_dtypes

    import giftcomm as gc
    from giftcomm.reference import simulate_reduce_scatter
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    p, rng = 3, np.random.default_rng(5)
    xs = [rng.standard_normal(3001).astype(ml_dtypes.bfloat16) for _ in range(p)]
    ts = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda() for x in xs]

    def body(t):
        shard = gc.reduce_scatter(ts[t.rank], comm=t, op="avg", algorithm="direct")
        full = gc.allreduce(ts[t.rank], comm=t, algorithm="ring")
        assert shard.dtype == torch.bfloat16 and shard.is_cuda and full.dtype == torch.bfloat16
        return [v.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16) for v in (shard, full)]

    got = DeviceLoopbackGroup(p).run(body)
    shards = simulate_reduce_scatter(xs, "e4m3", 256, "avg", "direct")
    full = simulate_allreduce(xs, "e4m3", 256, "sum", algorithm="ring")
    for r in range(p):
        assert got[r][0].tobytes() == shards[r].tobytes() and got[r][1].tobytes() == full[r].tobytes()


def test_kernels_adaptive_rows(cp, rng):
    """The adaptive rows' kernels on the device (tests/test_adaptive_gpu_emulated.py's checks):
    ada4_5 / ada4 and rows of 8 super-blocks per frame (several frames, a partial last one), every
    op, nearest and stochastic, against the reference bit for bit; a million values in one frame."""
    from tests import test_adaptive_gpu_emulated as ada

    for n in (1, 200, 257, 100_003, 1 << 20):
        for fmt in ada.TABLE:
            ada._check_ops(cp, rng, ada._nasty(rng, n, 256), giftcomm.formats.FORMATS[fmt], f"{fmt} n={n}",
                           msg_offset=n % 4)
    for n in (8 * 256 * 5 + 1000, 384 * 50 + 3):
        f = ada.SMALL[0] if n % 384 != 3 else ada._row(4500, 8, 600, block=384)
        ada._check_ops(cp, rng, ada._nasty(rng, n, f.default_block()), f, f"{f.name} n={n}", msg_offset=1)
