"""The GPU path's plumbing, checked on the CPU (no GPU needed; see docs/gpu.md for what is not).

- _xp: backend detection, fake device arrays (``__cuda_array_interface__`` over host memory, as
  in mpi4py's test suite), DLPack round trips with NumPy and torch CPU, bfloat16 bit conversions.
- The CUDA codec's scalar code (gc_fp8.cuh) compiled for the host (gc_host_emu.cpp): bit for bit
  against giftcomm.reference.codec on the edge tables and random data, and the portable
  float32 -> FP8 conversion exhaustively over every float32 in [0, max].
- The loader: include inlining and #line directives; NVRTC compile (when CuPy's NVRTC loads).
- CUDA-aware-MPI plumbing with fake device arrays (MPI test); the collectives on every backend
  and schedule are tests/test_collectives.py.
- The NCCL transport's queue / group logic with a recording fake NCCL.
- The batched transform plan against per-segment NumPy.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import ANY_BLOCK_FORMATS, E8M0_FORMATS, FIXED_BLOCK_FORMATS, PASS_THROUGH_FORMATS, native_only, scale_rule_edges

from giftcomm import _xp
from giftcomm.cuda import _loader
from giftcomm.formats import FORMATS, get_format, message_nbytes
from giftcomm.formats_header import c_header
from giftcomm.geometry.dense_plan import SegmentPair, TransformPlan
from giftcomm.reference import codec as ref
from studies.device.edge_cases import BLOCKS, LENGTHS, edge_vectors, floats_equal, messages_equal, random_vector

E4M3 = get_format("e4m3")  # the cost and byte formulas take the Format
ROOT = Path(__file__).resolve().parents[1]
SCALED = tuple(native_only(ANY_BLOCK_FORMATS))
EMU_FORMATS = SCALED + tuple(native_only(PASS_THROUGH_FORMATS))


class FakeDeviceArray:
    """A 'device' array over host memory: exposes only ``__cuda_array_interface__`` (v3)."""

    def __init__(self, host: np.ndarray) -> None:
        assert host.flags.c_contiguous
        self.host = host

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.host.shape, "typestr": self.host.dtype.str, "strides": None,
                "data": (self.host.ctypes.data, False), "version": 3, "stream": None}

    @property
    def nbytes(self) -> int:
        return self.host.nbytes


# ------------------------------------------------------------------------------------- _xp
def test_xp_detection():
    a = np.zeros(3, np.float32)
    fake = FakeDeviceArray(a)
    assert _xp.array_module(a) is np
    assert not _xp.is_device_array(a)
    assert _xp.is_device_array(fake)
    assert _xp.device_pointer(fake) == a.ctypes.data
    assert not _xp.is_device_array([1.0, 2.0])
    assert _xp.array_module([1.0]) is np


def test_xp_dtype_table():
    assert set(_xp.DTYPES) == {"float32", "float64", "float16", "bfloat16"}
    assert _xp.dtype_info(np.float32).itemsize == 4
    assert _xp.dtype_info("bfloat16").device_storage == np.uint16
    assert _xp.dtype_info(np.dtype(ml_dtypes.bfloat16)).host == np.dtype(ml_dtypes.bfloat16)
    from giftcomm.collectives.agree import DTYPE_CODES

    assert {k: v.code for k, v in _xp.DTYPES.items()} == DTYPE_CODES
    with pytest.raises(ValueError, match="unsupported dtype"):
        _xp.dtype_info(np.int32)


def test_xp_bf16_bits_match_ml_dtypes(rng):
    x = random_vector(rng, 100_000, spread=60)
    x[:6] = [np.nan, -np.nan, np.inf, -np.inf, 3.4e38, -0.0]
    bits = _xp.bf16_bits_from_float32(x)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(bits, want)
    back = _xp.to_float32(bits, "bfloat16")
    assert floats_equal(back, want.view(ml_dtypes.bfloat16).astype(np.float32)).all()


def test_xp_import_numpy_and_dlpack_cpu():
    a = np.arange(10, dtype=np.float32)
    imp = _xp.import_array(a)
    assert imp.array is a and imp.logical == "float32" and not imp.device
    view = _xp.import_array(memoryview(a))  # no DLPack: falls back to asarray
    assert view.logical == "float32"
    with pytest.raises(ValueError):
        _xp.import_array(np.arange(3))


def test_xp_dlpack_torch_cpu_zero_copy():
    import torch
    for tdt, logical in ((torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
                         (torch.float64, "float64")):
        t = torch.arange(8, dtype=tdt)
        imp = _xp.import_array(t)
        assert imp.source == "torch" and imp.logical == logical and not imp.device
        assert imp.array.ctypes.data == t.data_ptr()  # zero-copy
        if logical == "bfloat16":
            assert imp.array.dtype == np.dtype(ml_dtypes.bfloat16)
        out = _xp.export_like(imp.array.astype(imp.array.dtype) * 2, imp)
        assert isinstance(out, torch.Tensor) and out.dtype == tdt
        assert torch.equal(out, t * 2)


# ------------------------------------------------------------------------ host emulation
@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")
    assert cxx is not None, "a host C++ compiler (c++, g++ or clang++) is needed to build the CUDA codec's CPU emulation"
    out = tmp_path_factory.mktemp("emu") / "gc_emu.so"
    (out.parent / "gc_formats.h").write_text(c_header())  # the format table, as the loader serves it to NVRTC
    src = _loader.KERNEL_DIR / "gc_host_emu.cpp"
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
                    f"-I{_loader.KERNEL_DIR}", f"-I{out.parent}", str(src), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    ll, i, p = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p
    lib.gc_emu_encode.argtypes = [i, p, ll, i, p]
    lib.gc_emu_decode.argtypes = [i, p, ll, i, p, i]
    lib.gc_emu_dae.argtypes = [i, p, p, ll, i, p, p]
    lib.gc_emu_fp8_cast.argtypes = [i, p, ll, p]
    u64 = ctypes.c_uint64
    lib.gc_emu_mx_encode.argtypes = [i, p, ll, p, i, u64, u64]
    lib.gc_emu_mx_decode.argtypes = [i, p, ll, p, i]
    lib.gc_emu_mx_dae.argtypes = [i, p, p, ll, p, p, i, u64, u64]
    lib.gc_emu_sr8_encode.argtypes = [i, p, ll, i, p, u64, u64]
    lib.gc_emu_sr8_dae.argtypes = [i, p, p, ll, i, p, p, u64, u64]
    return lib


def _ptr(a):
    return None if a is None else a.ctypes.data


def emu_encode(lib, x, fmt, block):
    f = FORMATS[fmt]
    msg = np.full(message_nbytes(x.size, f, block), 0xAB, np.uint8)
    assert lib.gc_emu_encode(f.code, _ptr(x), x.size, block, _ptr(msg)) == 0
    return msg


def emu_decode(lib, msg, n, fmt, block, acc=None):
    out = np.full(n, np.nan, np.float32) if acc is None else acc
    assert lib.gc_emu_decode(FORMATS[fmt].code, _ptr(msg), n, block, _ptr(out), int(acc is not None)) == 0
    return out


def emu_dae(lib, msg, local, fmt, block, want_sum=True):
    f = FORMATS[fmt]
    out = np.full(message_nbytes(local.size, f, block), 0xCD, np.uint8)
    s = np.full(local.size, np.nan, np.float32) if want_sum else None
    assert lib.gc_emu_dae(f.code, _ptr(msg), _ptr(local), local.size, block, _ptr(out), _ptr(s)) == 0
    return out, s


def _check_all_ops(lib, x, fmt, block, rng, label):
    with np.errstate(all="ignore"):
        want = ref.encode(x, fmt, block)
        got = emu_encode(lib, x, fmt, block)
        ok, why = messages_equal(got, want, x.size, fmt, block)
        assert ok, f"{label}: encode: {why}"
        dec = emu_decode(lib, want, x.size, fmt, block)
        assert floats_equal(dec, ref.decode(want, x.size, fmt, block)).all(), f"{label}: decode"
        acc0 = random_vector(rng, x.size)
        acc = emu_decode(lib, want, x.size, fmt, block, acc=acc0.copy())
        assert floats_equal(acc, acc0 + ref.decode(want, x.size, fmt, block)).all(), f"{label}: accumulate"
        local = random_vector(rng, x.size)
        out, s = emu_dae(lib, want, local, fmt, block)
        total = ref.decode(want, x.size, fmt, block) + local
        ok, why = messages_equal(out, ref.encode(total, fmt, block), x.size, fmt, block)
        assert ok, f"{label}: decode_add_encode: {why}"
        assert floats_equal(s, total).all(), f"{label}: sum_out"


@pytest.mark.parametrize("fmt", EMU_FORMATS)
def test_emulation_edge_tables(emu, fmt, rng):
    for name, vec in edge_vectors(fmt).items():
        for block in (1, 3, 4, 256, 1000):
            _check_all_ops(emu, vec, fmt, block, rng, f"{fmt} {name} block={block}")


@pytest.mark.parametrize("fmt", EMU_FORMATS)
def test_emulation_random(emu, fmt, rng):
    for n in LENGTHS:
        for block in BLOCKS:
            x = random_vector(rng, n, spread=30)
            if n > 10:
                x[rng.integers(0, n)] = rng.choice([np.nan, np.inf, -np.inf])
            _check_all_ops(emu, x, fmt, block, rng, f"{fmt} n={n} block={block}")


def test_emulation_fp32_subnormal_sums_kept(emu):
    """The H200 case (2026-11-30): fp32 pass-through 0 + 5.877472e-39 must stay 5.877472e-39."""
    sub = np.array([5.877472e-39, -1e-45, 1e-40, 0.0], np.float32)
    msg = sub.view(np.uint8).copy()
    acc = emu_decode(emu, msg, sub.size, "fp32", 1, acc=np.zeros(sub.size, np.float32))
    assert np.array_equal(acc.view(np.uint32), sub.view(np.uint32))
    out, s = emu_dae(emu, msg, np.zeros(sub.size, np.float32), "fp32", 1)
    assert np.array_equal(out, msg) and np.array_equal(s.view(np.uint32), sub.view(np.uint32))


@pytest.mark.parametrize("fmt", SCALED)
def test_emulation_fp8_cast_exhaustive(emu, fmt):
    """The portable float32 -> FP8 conversion equals ml_dtypes' cast on every float32 in
    [-max, max] (positives exhaustively, negatives on every 3rd bit pattern)."""
    f = FORMATS[fmt]
    top = int(np.float32(f.max_value).view(np.uint32))
    step = 1 << 24
    for sign, stride in ((0, 1), (0x80000000, 3)):
        for lo in range(0, top + 1, step):
            bits = np.arange(lo, min(lo + step, top + 1), stride, dtype=np.uint32) | np.uint32(sign)
            v = bits.view(np.float32)
            got = np.empty(v.size, np.uint8)
            assert emu.gc_emu_fp8_cast(f.code, _ptr(v), v.size, _ptr(got)) == 0
            want = v.astype(f.wire_dtype).view(np.uint8)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, f"{fmt}: {v[bad[0]]!r} -> {got[bad[0]]:#x}, ml_dtypes {want[bad[0]]:#x}"


MX_FORMATS = tuple(native_only(FIXED_BLOCK_FORMATS))
SR_KEY, SR_OFF = 0x0123456789ABCDEF, (1 << 32) - 9


def _mx_check(lib, x, fmt, rounding, rng, what):
    """The emulated MX / nvfp4 kernels (and stochastic e4m3/e5m2) against the reference; fmt: a
    name or a Format (an MX scale-rule variant goes to the emulation as its variant code)."""
    f = get_format(fmt)
    n = x.size
    sr = int(rounding == "stochastic")
    kw = dict(rounding=rounding, key=SR_KEY, offset=SR_OFF)
    want = ref.encode(x, fmt, **kw)
    local = rng.standard_normal(n).astype(np.float32)
    got = np.full(want.size, 0xAA, np.uint8)
    out = np.full(want.size, 0x55, np.uint8)
    s = np.empty(n, np.float32)
    if f.fixed_block is None:  # stochastic e4m3 / e5m2, block 256
        assert lib.gc_emu_sr8_encode(f.code, _ptr(x), n, 256, _ptr(got), SR_KEY, SR_OFF) == 0
        assert lib.gc_emu_sr8_dae(f.code, _ptr(want), _ptr(local), n, 256, _ptr(out), _ptr(s), SR_KEY, SR_OFF) == 0
    else:
        assert lib.gc_emu_mx_encode(f.variant_code, _ptr(x), n, _ptr(got), sr, SR_KEY, SR_OFF) == 0
        assert lib.gc_emu_mx_dae(f.variant_code, _ptr(want), _ptr(local), n, _ptr(out), _ptr(s), sr, SR_KEY,
                                 SR_OFF) == 0
        dec = np.empty(n, np.float32)
        assert lib.gc_emu_mx_decode(f.code, _ptr(want), n, _ptr(dec), 0) == 0
        assert floats_equal(dec, ref.decode(want, n, fmt)).all(), f"decode {what}"
        acc = local.copy()
        assert lib.gc_emu_mx_decode(f.code, _ptr(want), n, _ptr(acc), 1) == 0
        with np.errstate(invalid="ignore", over="ignore"):
            assert floats_equal(acc, local + ref.decode(want, n, fmt)).all(), f"accumulate {what}"
    assert np.array_equal(got, want), f"encode {what}: bytes {np.flatnonzero(got != want)[:8]}"
    with np.errstate(invalid="ignore", over="ignore"):
        assert floats_equal(s, ref.decode(want, n, fmt) + local).all(), f"sum {what}"
    assert np.array_equal(out, ref.decode_add_encode(want, local, fmt, **kw)), f"decode_add_encode {what}"


@pytest.mark.parametrize("rule", ["ceil", "floor"])
@pytest.mark.parametrize("fmt", native_only(E8M0_FORMATS))
def test_emulation_mx_scale_rules(emu, fmt, rule, rng):
    """Both E8M0 scale rules (gc_mx.cuh gc_mx_scale_code) at the rules' edges, both roundings."""
    x = scale_rule_edges(rng, fmt)
    for rounding in ("nearest", "stochastic"):
        _mx_check(emu, x, get_format(fmt).with_scale_rule(rule), rounding, rng, f"{fmt} mx_scale={rule} {rounding}")


# nearest e4m3/e5m2 are test_emulation_edge_tables / test_emulation_random
@pytest.mark.parametrize("fmt,rounding", [(f, r) for f in MX_FORMATS + SCALED for r in ("nearest", "stochastic")
                                          if not (f in SCALED and r == "nearest")])
def test_emulation_mx_formats_and_stochastic_rounding(emu, fmt, rounding, rng):
    for name, vec in edge_vectors("e4m3").items():
        _mx_check(emu, vec, fmt, rounding, rng, f"{fmt} {rounding} {name}")
    for n in (0, 1, 2, 15, 17, 33, 1023, 1025, 3000):
        x = random_vector(rng, n, spread=25)
        if n > 40:
            x[rng.integers(0, n, 2)] = [np.nan, -np.inf]
            x[n // 3 : n // 3 + 40] *= np.float32(2.0**-110)
        _mx_check(emu, x, fmt, rounding, rng, f"{fmt} {rounding} n={n}")


# ---------------------------------------------------------------------------------- loader
def test_loader_source_text_and_line_directives():
    text = _loader.source_text("codec")
    lines = text.splitlines()
    cu = _loader.source_path("codec")
    cuh = _loader.KERNEL_DIR / "gc_fp8.cuh"
    assert lines[0] == f'#line 1 "{cu}"'
    assert f'#line 1 "{cuh}"' in lines
    assert not any(line.strip().startswith('#include "') for line in lines)
    # after the header, the directive names the .cu line right after the #include
    inc_line = next(i for i, l in enumerate(cu.read_text().splitlines(), 1) if l.startswith('#include "gc_fp8.cuh"'))
    assert f'#line {inc_line + 1} "{cu}"' in lines
    assert "gc_e4m3" in text and "#pragma once" not in text


def test_loader_finds_sources_as_package_data():
    import giftcomm.cuda

    kdir = Path(giftcomm.cuda.__file__).parent / "kernels"
    assert (kdir / "gc_codec.cu").is_file() and (kdir / "gc_fp8.cuh").is_file()
    with pytest.raises(ValueError, match="unknown CUDA module"):
        _loader.source_path("nope")


def test_check_cuda_script_passes():
    res = subprocess.run(["bash", str(ROOT / "native" / "check_cuda.sh")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "FAIL" not in res.stdout


_FTZ_OPS = re.compile(r"^\s*(\w+)((?:\.\w+)*)\.ftz((?:\.\w+)*)\s", re.M)


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(), reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_never_flush_subnormals_even_with_ftz(tmp_path, arch):
    """Every float32 instruction of the codec kernels ignores -ftz=true (CuPy compiles with it,
    and recent versions add it to RawModule options): the loader text compiled by nvcc -ptx -ftz=true has no .ftz instruction at
    all (adds / multiplies / divides are explicit non-.ftz PTX, clips and compares work on bits),
    and the add / mul / div instructions are all there."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    src = tmp_path / "codec.cu"
    src.write_text(_loader.source_text("codec"))
    ptx = tmp_path / "codec.ptx"
    subprocess.run([nvcc, "-ptx", "-std=c++17", "-ftz=true", f"-arch={arch}", str(src), "-o", str(ptx)],
                   check=True, capture_output=True, timeout=300)
    text = ptx.read_text()
    flushed = sorted({m.group(0).strip() for m in _FTZ_OPS.finditer(text)})
    assert not flushed, f"flush-to-zero instructions in the PTX under -ftz=true: {flushed}"
    for op in ("add.rn.f32", "mul.rn.f32", "div.rn.f32"):
        assert op in text, op
    assert "fma.rn.f32" not in text


# ------------------------------------------------------------- CUDA-aware MPI plumbing
@pytest.mark.mpi
def test_device_mpi_transport_fake_device_buffers():
    """CUDA-aware MPI plumbing with fake device arrays (MPICH reads the host memory behind the
    pointer): raw messages (the collectives over it: tests/test_collectives.py)."""
    from mpi4py import MPI

    from giftcomm.transport.device_mpi import CudaSupport, DeviceMpiTransport, cuda_support

    comm = MPI.COMM_WORLD
    support = cuda_support()
    assert isinstance(support, CudaSupport) and support.how
    t = DeviceMpiTransport(comm, require_cuda_aware=False)
    p, r = t.size, t.rank
    send = np.full(37, r, np.uint8)
    recv = np.zeros(37, np.uint8)
    reqs = [t.irecv(FakeDeviceArray(recv), (r - 1) % p, tag=5), t.isend(FakeDeviceArray(send), (r + 1) % p, tag=5)]
    for q in reqs:
        q.wait()
    assert (recv == (r - 1) % p).all()
    with pytest.raises(TypeError, match="device array"):
        t.isend(send, (r + 1) % p)
    t.free()


def test_device_mpi_refuses_host_only_mpi(monkeypatch):
    from mpi4py import MPI

    from giftcomm.transport import device_mpi

    monkeypatch.setenv("GIFTCOMM_CUDA_AWARE_MPI", "0")
    assert device_mpi.cuda_support() == device_mpi.CudaSupport(False, "GIFTCOMM_CUDA_AWARE_MPI")
    with pytest.raises(RuntimeError, match="not CUDA-aware"):
        device_mpi.DeviceMpiTransport(MPI.COMM_SELF)
    monkeypatch.setenv("GIFTCOMM_CUDA_AWARE_MPI", "1")
    assert device_mpi.cuda_support().supported is True


# --------------------------------------------------------------------- NCCL queue logic
class _FakeNccl:
    NCCL_UINT8, NCCL_INT64 = 0, 1
    available = True

    def __init__(self):
        self.log = []

    def groupStart(self):
        self.log.append(("start",))

    def groupEnd(self):
        self.log.append(("end",))

    def get_unique_id(self):
        return (1, 2, 3)

    def NcclCommunicator(self, n, uid, rank):
        log = self.log

        class Comm:
            def send(self, ptr, nbytes, dtype, peer, stream):
                log.append(("send", ptr, nbytes, peer, stream))

            def recv(self, ptr, nbytes, dtype, peer, stream):
                log.append(("recv", ptr, nbytes, peer, stream))

            def destroy(self):
                log.append(("destroy",))

        return Comm()


class _FakeCupyLike(FakeDeviceArray):
    @property
    def flags(self):
        return self.host.flags


def test_nccl_transport_groups_queued_ops(monkeypatch):
    from giftcomm.transport import nccl as tn

    fake = _FakeNccl()
    monkeypatch.setattr(tn, "_nccl", lambda: fake)
    monkeypatch.setattr(tn, "_current_stream_ptr", lambda: 77)
    t = tn.NcclTransport((1, 2, 3), rank=1, size=3)
    a, b = _FakeCupyLike(np.zeros(10, np.uint8)), _FakeCupyLike(np.zeros(6, np.uint8))
    rq = t.irecv(a, 0)
    sq = t.isend(b, 2)
    assert fake.log == []  # queued, nothing issued yet
    rq.wait()
    assert fake.log == [("start",), ("recv", a.host.ctypes.data, 10, 0, 77), ("send", b.host.ctypes.data, 6, 2, 77), ("end",)]
    sq.wait()  # already issued: no second group
    assert len(fake.log) == 4
    t.sendrecv(b, 2, a, 0)
    assert [e[0] for e in fake.log[4:]] == ["start", "recv", "send", "end"]
    with pytest.raises(TypeError):
        t.isend(np.zeros(3, np.uint8), 0)
    # the device ring's pattern (recv + send queued, then wait) issues one group per hop
    fake.log.clear()
    t.free()
    assert fake.log == [("destroy",)]


# ----------------------------------------------------------------------------- transform
def test_transform_plan_matches_numpy(rng):
    segs, start, pairs = [(64, 48), (64, 48), (32, 32), (10, 7), (64, 48)], 5, []
    for k, (m, n) in enumerate(segs):
        left = (np.eye(m) + rng.standard_normal((m, m)) / np.sqrt(m)).astype(np.float32) if k != 3 else None
        right = (np.eye(n) + rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32) if k != 2 else None
        pairs.append(SegmentPair(start, m, n, left, right))
        start += m * n + 3
    size = start + 11
    plan = TransformPlan(size, pairs)
    x = rng.standard_normal(size).astype(np.float32)
    y = plan.forward(x)
    want = x.copy()
    for p in pairs:
        blk = x[p.start : p.start + p.size].reshape(p.m, p.n).astype(np.float64)
        if p.left is not None:
            blk = p.left.astype(np.float64) @ blk
        if p.right is not None:
            blk = blk @ p.right.astype(np.float64)
        want[p.start : p.start + p.size] = blk.reshape(-1)
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-5
    z = plan.inverse(y)
    assert np.linalg.norm(z - x) / np.linalg.norm(x) < 1e-3
    assert len(plan.groups) == 3 and plan.flops() > 0
    with pytest.raises(ValueError):
        TransformPlan(10, [SegmentPair(5, 2, 3)])


def test_transform_plan_shares_the_geometry_dense_kernel(rng):
    """TransformPlan's batched product is giftcomm.geometry.apply.dense_apply, and a Geometry
    with full (dense) sides gives the same buffer as a plan of the same operators."""
    import giftcomm.geometry.dense_plan as ct
    from giftcomm.geometry import Geometry, Layout
    from giftcomm.geometry.apply import dense_apply

    assert ct.dense_apply is dense_apply
    layout = Layout([("a", (24, 16)), ("b", (24, 16))])
    spd = lambda d: (lambda q: (q * np.logspace(0, -2, d)) @ q.T)(np.linalg.qr(rng.standard_normal((d, d)))[0])  # noqa: E731
    geo = Geometry.from_kfac(layout, {"a": (spd(16), spd(24)), "b": (spd(16), spd(24))})
    pairs = [SegmentPair(t.segment.offset, 24, 16, t.left.fwd, t.right.fwd, t.left.inv, t.right.inv)
             for t in geo.transforms]
    plan = TransformPlan(layout.size, pairs)
    x = rng.standard_normal(layout.size).astype(np.float32)
    np.testing.assert_allclose(plan.forward(x), geo.forward(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.inverse(x), geo.inverse(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- python -m giftcomm.perf device
def test_device_bench_without_gpu_exits_2(capsys, monkeypatch):
    import giftcomm.cuda
    from giftcomm.perf import __main__ as perf_main

    monkeypatch.setattr(giftcomm.cuda, "available", lambda: False)
    assert perf_main.main(["device", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_device_bench_arguments_and_tables():
    from giftcomm.perf import device_bench as db

    a = db.parse_args(["--quick", "--blocks", "16,1024,8192", "--formats", "e4m3,nvfp4", "--sections", "codec,gift"])
    assert a.log2n == 24 and a.reps == 5 and a.blocks == [16, 1024, 8192] and a.sections == ["codec", "gift"]
    with pytest.raises(SystemExit):
        db.parse_args(["--formats", "bf16"])
    with pytest.raises(SystemExit):
        db.parse_args(["--sections", "nope"])
    defaults = db.parse_args([])
    cases = db.codec_cases(defaults.formats, defaults.blocks)
    assert ("e4m3", 16) in cases and ("e5m2", 8192) in cases and ("nvfp4", None) in cases and ("mxfp4", None) in cases
    n = 1 << 20
    # bytes per value: e4m3 block 256 = 1 + 4/256 on the wire
    w = 1 + 4 / 256
    assert db.bytes_per_value("encode", E4M3, 256, n) == pytest.approx(4 + w)
    assert db.bytes_per_value("decode_add_encode", E4M3, 256, n) == pytest.approx(4 + 2 * w)
    assert db.bytes_per_value("decode_accumulate", E4M3, 256, n) == pytest.approx(8 + w)
    nvfp4 = get_format("nvfp4")
    assert db.bytes_per_value("decode", nvfp4, None, n) == pytest.approx(4 + db.wire_bytes_per_value(nvfp4, None, n))
    copy_gbs, line = db.format_copy(0.5, 4 * n)  # 8 MiB read + written in 0.5 ms
    assert copy_gbs == pytest.approx(2 * 4 * n / 0.5 / 1e6) and "GB/s" in line
    times = {(f, b, op): 0.01 for f, b in (("e4m3", 256), ("e4m3", 8192), ("nvfp4", None)) for op in db.OPS}
    table = db.format_codec_table(times, n, copy_gbs)
    rows = table.splitlines()
    assert len(rows) == 2 + len(times)
    enc = next(r for r in rows if r.startswith("| e4m3 | 256 | encode"))
    gbs = (4 + w) * n / 0.01 / 1e6
    assert f"| {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |" in enc
    # the two-pass kernels: encode above block 4096, decode_add_encode above 8192 (stochastic alike)
    assert "| e4m3 | 8192 (two-pass) | encode |" in table and "| e4m3 | 8192 (two-pass) | encode_sr |" in table
    assert "| e4m3 | 8192 | decode_add_encode |" in table and "| e4m3 | 8192 | decode_add_encode_sr |" in table
    assert db.two_pass("decode_add_encode_sr", get_format("e5m2"), 16384) and not db.two_pass("decode", E4M3, 16384)
    assert db.bytes_per_value("decode_add_encode_sr", E4M3, 256, n) == db.bytes_per_value("decode_add_encode", E4M3, 256, n)
    assert any(r.startswith("| nvfp4 | 16 |") for r in rows)
    peer = {"giftcomm encode": 0.4, "torch.compile encode": 0.3, "eager encode": 2.0, "giftcomm decode": 0.5,
            "eager decode": 1.5, "giftcomm decode_add_encode": 0.6, "torch.compile decode_add_encode": 0.9}
    pt = db.format_peer_table(peer, n, copy_gbs)
    assert "| torch.compile | encode | 0.300 |" in pt and "0.75x" in pt and "torch.compile | decode |" not in pt
    assert "| torch.compile | decode_add_encode | 0.900 |" in pt and "1.50x" in pt
    assert db.layer_values() == 4 * 1024 * 1024 + 3 * 2816 * 1024
    tr = db.format_transform(0.9, 0.8, db.layer_values(), 32, 4000.0)
    assert "1.700 ms" in tr and "k=32" in tr
    # the fused transform's targets: compute ratio, HBM roofline share, the step at 100/200/400 Gbit/s
    n = db.layer_values()
    t = {"gift": 3.0, "plain": 1.0, "plain_codec": 0.3, "gift_codec": 0.6, "forward": 0.1, "inverse": 0.1, "diff": 0.01}
    g = db.format_gift(t, n, 4000.0)
    assert "**2.00x** (target <= 1.5x: **missed**)" in g
    floor = 16 * n / 4e9  # ms: one float32 read + write per direction at 4000 GB/s
    assert f"**0.200 ms**, {100 * floor / 0.2:.0f}% of the HBM roofline ({floor:.3f} ms" in g and "1.00e-02" in g
    assert "(target <= 1.5x: met)" in db.format_gift({**t, "gift_codec": 0.45}, n, 4000.0)
    assert "target >= 50%: met" in db.format_gift({**t, "forward": 0.01, "inverse": 0.01}, n, 4000.0)
    rows = [r for r in g.splitlines() if r.startswith("| 1") or r.startswith("| 2") or r.startswith("| 4")]
    assert [r.split(" | ")[0] for r in rows] == ["| 100", "| 200", "| 400"]
    fp8, bf = 2 * (n + 4 * -(-n // 256)) * 8 / 400e9 * 1e3, 4 * n * 8 / 400e9 * 1e3
    assert rows[2] == (f"| 400 | {fp8:.3f} | {bf:.3f} | {fp8 + 0.3:.3f} | {fp8 + 0.6:.3f} | "
                       f"{100 * 0.6 / (fp8 + 0.6):.0f}% | {(fp8 + 0.6) / bf:.2f} | {bf - fp8 - 0.6:.3f} |")


def test_device_bench_timer_amortizes_the_launch_gap():
    """giftcomm.perf.device_bench.event_timer: several back-to-back calls between one event pair,
    the elapsed time divided by their number (the host's launch gap is not counted per call)."""
    from types import SimpleNamespace

    from giftcomm.perf.device_bench import event_timer

    clock = {"t": 0.0}
    calls = []

    class Event:
        def record(self):
            self.t = clock["t"]

        def synchronize(self):
            pass

    def fn():
        calls.append(1)
        clock["t"] += 2.0  # each call keeps the device busy 2 ms

    cuda = SimpleNamespace(Event=Event, Device=lambda: SimpleNamespace(synchronize=lambda: None),
                           get_elapsed_time=lambda a, b: b.t - a.t)
    ms = event_timer(SimpleNamespace(cuda=cuda), warmup=2, reps=3, calls=5)(fn)
    assert ms == pytest.approx(2.0) and len(calls) == 2 + 3 * 5
