"""The adaptive rows' native C codec equals giftcomm.reference.adaptive bit for bit.

Messages are compared byte for byte; decoded values as float32 bit patterns with NaN positions
equal (NaN payloads are not part of the contract). Every kernel variant this CPU runs is tested
(generic, avx2, avx512...). Specs: the table's rows and variants of them with small frames (so
that a test message has several frames and a partial last one) and each 8-bit / 4-bit tier
element, all passed to the kernels from their AdaptiveSpec (giftcomm.codec.native_code).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import giftcomm as gc
from giftcomm import codec
from giftcomm.formats import FORMATS, Format, message_nbytes
from giftcomm.reference import codec as ref
from giftcomm.reference import simulate_allreduce

native = pytest.importorskip("giftcomm._codec_native")

B = 256
ADAPTIVE = [name for name, f in FORMATS.items() if f.adaptive is not None]


def variant(fmt: str, **changes) -> Format:
    f = FORMATS[fmt]
    assert f.adaptive is not None
    return replace(f, adaptive=replace(f.adaptive, **changes))


#: the table's rows, and small-frame variants with every tier element the spec allows
SPECS = {name: FORMATS[name] for name in ADAPTIVE}
SPECS.update({f"{name}/frame8/{top}/{mid}": variant(name, frame=8, top=top, mid=mid)
              for name in ADAPTIVE for top in ("e4m3", "int8") for mid in ("e2m1", "int4")})
SPECS["ada4_5/frame1"] = variant(ADAPTIVE[0], frame=1, share8_permille=1000)
SPECS["ada4/frame5/share0"] = variant(ADAPTIVE[-1], frame=5, share8_permille=0)
#: counts: empty, one partial super-block, exactly one, one and a bit, one frame of 8, several
#: frames with a partial last frame whose last super-block is partial
COUNTS = [0, 1, 255, 256, 257, 8 * B, 3 * 8 * B + 5 * B + 77]



def assert_same_f32(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    gn, wn = np.isnan(got), np.isnan(want)
    assert np.array_equal(gn, wn), f"{what}: NaN positions differ at {np.nonzero(gn != wn)[0][:8]}"
    diff = np.nonzero((got.view(np.uint32) != want.view(np.uint32)) & ~gn)[0]
    assert diff.size == 0, f"{what}: {diff.size} values differ, first at {diff[:8]}: {got[diff[:4]]} != {want[diff[:4]]}"


def data(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    """Test values of one kind: gradient-like (each super-block its own log-normal scale),
    heavy-tailed, with NaN / Inf super-blocks, all zero, tied amax, tiny and huge."""
    nb = -(-n // B)
    if n == 0:
        return np.zeros(0, np.float32)
    if kind == "spread":
        x = rng.standard_normal(n) * np.repeat(np.exp(2 * rng.standard_normal(nb)), B)[:n]
    elif kind == "heavy":
        x = rng.standard_t(1.2, n) * 1e-3
    elif kind == "nonfinite":
        x = rng.standard_normal(n) * np.repeat(np.exp(3 * rng.standard_normal(nb)), B)[:n]
        for v in (np.inf, -np.inf, np.nan):
            x[rng.integers(0, n, max(1, n // 900))] = v
    elif kind == "zero":
        x = np.zeros(n)
        x[rng.integers(0, n, n // 3)] = -0.0
    elif kind == "ties":  # few distinct amax values, each on many super-blocks
        x = rng.uniform(-1, 1, n)
        top = rng.choice([0.5, 1.0, 2.0], nb)
        for j in range(nb):
            lo, hi = j * B, min(n, (j + 1) * B)
            x[lo + rng.integers(0, hi - lo)] = top[j] * rng.choice([-1, 1])
            x[lo:hi] = np.clip(x[lo:hi], -top[j], top[j])
        x[rng.random(n) < 0.1] = 0.0  # groups of zeros inside super-blocks
    elif kind == "extreme":  # subnormal, tiny (< 2^-100) and near-overflow super-blocks
        scale = rng.choice([1e-42, 1e-38, 1e-31, 3e-30, 1.0, 1e30, 3e38], nb)
        x = rng.uniform(-1, 1, n) * np.repeat(scale, B)[:n]
    else:
        raise AssertionError(kind)
    return x.astype(np.float32)


KINDS = ["spread", "heavy", "nonfinite", "zero", "ties", "extreme"]


def native_encode(x: np.ndarray, f: Format, key: int | None = None, offset: int = 0) -> np.ndarray:
    assert codec.native_supports(f), f"{f.name} {f.adaptive} is not native"
    out = np.full(message_nbytes(x.size, f), 0xA5, np.uint8)  # every byte must be written
    codec.NativeKernels.encode(x, f, B, out, key, offset)
    return out


def native_decode(msg: np.ndarray, n: int, f: Format) -> np.ndarray:
    out = np.full(n, np.nan, np.float32)
    codec.NativeKernels.decode(msg, n, f, B, out)
    return out


def ref_encode(x: np.ndarray, f: Format, key: int | None = None, offset: int = 0) -> np.ndarray:
    if key is None:
        return ref.encode(x, f)
    return ref.encode(x, f, rounding="stochastic", key=key, offset=offset)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", list(SPECS))
def test_encode_decode_equal_the_reference(isa, spec, rng):
    f = SPECS[spec]
    for n in COUNTS:
        for kind in KINDS:
            x = data(rng, kind, n)
            what = f"{spec} n={n} {kind} {isa}"
            for key, offset in ((None, 0), (int(rng.integers(0, 2**63)), int(rng.integers(0, 2**40))),
                                (12345, 2**32 - 300)):  # counters crossing a multiple of 2^32
                msg = native_encode(x, f, key, offset)
                want = ref_encode(x, f, key, offset)
                bad = np.nonzero(msg != want)[0]
                assert bad.size == 0, f"{what} key={key}: {bad.size} bytes differ, first at {bad[:8]}"
                assert_same_f32(native_decode(msg, n, f), ref.decode(want, n, f), what)


def test_the_input_is_left_alone(rng):
    f = FORMATS[ADAPTIVE[0]]
    x = data(rng, "nonfinite", 5 * B + 3)
    keep = x.copy()
    msg = native_encode(x, f, 7, 0)
    assert np.array_equal(x.view(np.uint32), keep.view(np.uint32))
    mcopy = msg.copy()
    native_decode(msg, x.size, f)
    assert np.array_equal(msg, mcopy)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", [s for s in SPECS if "frame8" in s] + ADAPTIVE)
def test_decode_of_any_bytes_with_valid_choice_bits(isa, spec, rng):
    """Random payload and super-scale bytes (NaN / Inf scales, E4M3 NaN scale codes, every
    element code) under valid choice bits decode as the reference decodes them."""
    f = SPECS[spec]
    n = 3 * 8 * B + 100
    msg = ref.encode(data(rng, "spread", n), f)
    noise = rng.integers(0, 256, msg.size, dtype=np.uint8)
    spec_ = f.adaptive
    pos = 0
    nsb = -(-n // B)
    for j0 in range(0, nsb, spec_.frame):  # keep each frame's choice bits
        m = min(spec_.frame, nsb - j0)
        cb = 4 * -(-m // 16)
        noise[pos : pos + cb] = msg[pos : pos + cb]
        scales = noise[pos + cb : pos + cb + 4 * m].view(np.float32)
        pick = rng.random(m)
        scales[pick < 0.1] = np.inf
        scales[(pick >= 0.1) & (pick < 0.2)] = np.nan
        pos += spec_.frame_nbytes(m, B)
    with np.errstate(all="ignore"):
        want = ref.decode(noise, n, f)
    assert_same_f32(native_decode(noise, n, f), want, spec)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", [ADAPTIVE[0], f"{ADAPTIVE[-1]}/frame8/e4m3/e2m1", f"{ADAPTIVE[0]}/frame8/int8/int4"])
def test_fused_hop_and_accumulate_equal_the_reference(isa, spec, rng):
    f = SPECS[spec]
    for n in (300, 3 * 8 * B + 5 * B + 77):
        x, local = data(rng, "spread", n), data(rng, "nonfinite", n)
        msg = ref.encode(x, f)
        for key in (None, 99):
            want_sum = np.empty(n, np.float32)
            want = codec.ReferenceKernels.decode_add_encode(msg, local, f, B, np.empty_like(msg), want_sum, key, 5)
            got_sum = np.empty(n, np.float32)
            got = codec.NativeKernels.decode_add_encode(msg, local, f, B, np.empty_like(msg), got_sum, key, 5)
            assert np.array_equal(got, want) and np.array_equal(msg, ref.encode(x, f))
            assert_same_f32(got_sum, want_sum, spec)
            # no sum_out; then in place: the message and sum_out aliasing its inputs
            assert np.array_equal(codec.NativeKernels.decode_add_encode(msg, local, f, B, np.empty_like(msg), None,
                                                                        key, 5), want)
            inplace, loc = msg.copy(), local.copy()
            native.decode_add_encode(inplace, loc, inplace, loc, codec.native_code(f), B, key, 5)
            assert np.array_equal(inplace, want)
            assert_same_f32(loc, want_sum, spec)
        acc, acc_ref = local.copy(), local.copy()
        codec.NativeKernels.decode_accumulate(msg, acc, f, B)
        codec.ReferenceKernels.decode_accumulate(msg, acc_ref, f, B)
        assert_same_f32(acc, acc_ref, spec)


@pytest.mark.parametrize("spec", [ADAPTIVE[0], f"{ADAPTIVE[0]}/frame8/e4m3/e2m1"])
def test_corrupt_choice_bits_raise_the_reference_error(spec, rng):
    f = SPECS[spec]
    n = 3 * 8 * B + 5 * B + 77 if "frame8" in spec else 20 * B
    msg = ref.encode(data(rng, "spread", n), f)
    last = message_nbytes(n, f) - f.adaptive.frame_nbytes(-(-n // B) % f.adaptive.frame or f.adaptive.frame, B)
    for at, flip in ((0, 0x3), (0, 0x1), (last, 0x2)):  # a frame's counts change (the last frame's too)
        bad = msg.copy()
        bad[at] ^= flip
        with pytest.raises(ValueError) as want:
            ref.decode(bad, n, f)
        for call in (lambda: native_decode(bad, n, f),
                     lambda: codec.NativeKernels.decode_accumulate(bad, np.zeros(n, np.float32), f, B),
                     lambda: codec.NativeKernels.decode_add_encode(bad, np.zeros(n, np.float32), f, B,
                                                                   np.empty_like(bad), None)):
            with pytest.raises(ValueError) as got:
                call()
            assert str(got.value) == str(want.value)
            assert "corrupt adaptive message" in str(got.value)
    # the public decode says the same
    bad = msg.copy()
    bad[0] ^= 0x3
    if spec in FORMATS:
        with pytest.raises(ValueError, match="corrupt adaptive message"):
            codec.decode(bad, n, spec)


def test_the_rows_are_native_and_run_through_the_c_kernels(rng, monkeypatch):
    calls = []
    real = codec._native.encode
    monkeypatch.setattr(codec._native, "encode", lambda *a: calls.append(a[2]) or real(*a))
    for name in ADAPTIVE:
        f = FORMATS[name]
        assert f.native and name in codec.native_formats() and codec.native_supports(f)
        x = data(rng, "spread", 1000)
        assert np.array_equal(codec.encode(x, name), ref.encode(x, f))
    assert [c & 0xFF for c in calls] == [FORMATS[n].code for n in ADAPTIVE]
    # the code carries the spec's slot; a bare row code (no spec) is refused, never guessed
    x = np.ones(10, np.float32)
    f = FORMATS[ADAPTIVE[0]]
    with pytest.raises(ValueError, match="adaptive format"):
        real(x, np.empty(message_nbytes(10, f), np.uint8), f.code, B)
    with pytest.raises(ValueError, match="below what a frame"):
        native._adaptive_slot(1000, 4, 0, "int8", "int4", B)
    with pytest.raises(ValueError, match="adaptive spec"):
        native._adaptive_slot(4500, 4, 0, "e5m2", "int4", B)


@pytest.mark.parametrize("fmt", ADAPTIVE)
@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_allreduce_with_the_native_codec_equals_the_simulation(fmt, algorithm, rng, monkeypatch):
    monkeypatch.setenv("GIFTCOMM_NATIVE", "1")
    assert codec.kernels_for(np) is codec.NativeKernels and codec.native_supports(FORMATS[fmt])
    used = []
    real = codec._native.decode_add_encode, codec._native.encode
    monkeypatch.setattr(codec._native, "encode", lambda *a: used.append("encode") or real[1](*a))
    monkeypatch.setattr(codec._native, "decode_add_encode", lambda *a: used.append("hop") or real[0](*a))
    p, n = 3, 2 * 64 * B + 777
    xs = [data(rng, "spread", n) for _ in range(p)]
    xs[1][5 * B + 3] = np.inf  # one poisoned super-block
    for rounding, seed in (("nearest", None), ("stochastic", 11)):
        outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], fmt=fmt, algorithm=algorithm, comm=t,
                                                              rounding=rounding, seed=seed))
        want = simulate_allreduce(xs, fmt, algorithm=algorithm, rounding=rounding, seed=seed)
        for got, w in zip(outs, want):
            assert_same_f32(got, w, f"{fmt} {algorithm} {rounding}")
    assert "encode" in used


@pytest.mark.mpi
def test_plans_over_mpi_equal_the_simulation():
    """Under mpiexec: a persistent one-shot plan runs through the node-shared channel, whose C
    code encodes and decodes with the row's native code (its spec's slot); it and the ring plan
    equal the simulation."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    gen = np.random.default_rng(91)
    n = 5 * B + 77
    xs = [(gen.standard_normal(n) * np.repeat(np.exp(2 * gen.standard_normal(6)), B)[:n]).astype(np.float32)
          for _ in range(comm.size)]
    for fmt in ADAPTIVE:
        for algorithm in ("oneshot", "ring"):
            want = simulate_allreduce(xs, fmt=fmt, algorithm=algorithm)[comm.rank]
            plan = gc.plan_allreduce(xs[comm.rank], comm=comm, fmt=fmt, algorithm=algorithm)
            if algorithm == "oneshot":
                assert plan.through_channel and plan._fmt_code == codec.native_code(FORMATS[fmt])
            for _ in range(2):
                assert plan(xs[comm.rank]).tobytes() == want.tobytes(), (fmt, algorithm)
