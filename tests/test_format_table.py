"""The format table is the one source of the formats' codes and facts for every language.

- native/gc_formats.h is exactly what giftcomm.formats_header.c_header() makes of the table
  (regenerate with ``python -m giftcomm.formats_header > native/gc_formats.h``);
- no C, CUDA or CUDA-launch source compares a format code with a bare integer;
- the native build and the CUDA kernels implement exactly the rows declared native
  (Format.native), and a row declared reference-only (a format landing Python-first) runs
  everywhere through the reference kernels (encode/decode, the fused hop, plain calls, plans, the
  simulation, error feedback, the torch and JAX adapters), with one log line per format.
"""
from __future__ import annotations

import logging
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import torch_seeded

import giftcomm as gc
from giftcomm import GiftSchedule, codec, formats
from giftcomm.cuda import _loader
from giftcomm.cuda import codec as cuda_codec
from giftcomm.formats import FORMATS, FORMATS_BY_CODE, get_format, message_nbytes
from giftcomm.formats_header import HEADER_PATH, c_header, format_facts
from giftcomm.geometry import fused as cuda_fused
from giftcomm.reference import codec as ref
from giftcomm.reference import simulate_allreduce, simulate_reduce_scatter

ROOT = Path(__file__).resolve().parents[1]


def test_checked_in_header_is_generated_from_the_table():
    path = ROOT / HEADER_PATH
    assert path.read_text() == c_header(), (
        f"{HEADER_PATH} differs from giftcomm/formats.py: python -m giftcomm.formats_header > {HEADER_PATH}")
    text = c_header()
    for f in FORMATS.values():
        assert f"#define GC_{f.name.upper()} {f.code}\n" in text
        assert f'#define GC_{f.name.upper()}_FACTS "{format_facts(f)}"' in text


def test_header_check_command_fails_on_a_difference(tmp_path):
    from giftcomm.formats_header import _main

    stale = tmp_path / "gc_formats.h"
    stale.write_text(c_header().replace("#define GC_E5M2 2", "#define GC_E5M2 3"))
    assert _main(["--check", str(stale)]) == 1
    stale.write_text(c_header())
    assert _main(["--check", str(stale)]) == 0


# a format code or element kind compared with, or range-checked against, a bare integer
_BARE = re.compile(r"\b(fmt|fmt_code|ek|EK)\s*(==|!=|<=|>=|<|>)\s*\d|\d\s*(==|!=|<=|>=|<|>)\s*(fmt|fmt_code|ek|EK)\b")


def _sources() -> list[Path]:
    kernels = _loader.KERNEL_DIR
    return (sorted((ROOT / "native").glob("*.[ch]")) + sorted(kernels.glob("*.cu")) + sorted(kernels.glob("*.cuh"))
            + sorted(kernels.glob("*.cpp")) + sorted((ROOT / "giftcomm" / "cuda").glob("*.py"))
            + [ROOT / "giftcomm" / "codec.py"])


def test_no_bare_integer_format_codes_in_the_kernels():
    hits = []
    for path in _sources():
        if path.name == "gc_formats.h":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if _BARE.search(line.split("//")[0].split("/*")[0].split("#")[0] if path.suffix == ".py" else
                            line.split("//")[0].split("/*")[0]):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not hits, "format codes must come from gc_formats.h / giftcomm.formats:\n" + "\n".join(hits)


def _entry_formats(module: str) -> set[str]:
    """The format names of a CUDA module's decode entry points (gc_dec_F, gc_mx_dec_F, gc_pt_F,
    gc_fz_dec_F), from the text the loader hands NVRTC, preprocessed (the generated row lists
    expanded) the way the emulator reads it."""
    from tests.emulator import build as emu_build

    names = emu_build.kernel_table(_loader.source_text(module))
    return {m.group(1) for n in names if (m := re.fullmatch(r"gc_(?:mx_dec|dec|pt|fz_dec)_(\w+)", n))}


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ (the preprocessor of the kernel sources) is not installed")
def test_cuda_entry_points_are_the_native_rows():
    # the codec's entry points cover the native rows but the adaptive ones; the adaptive rows with
    # INT8 / INT4 tiers have their own kernels (gc_adaptive.cuh)
    native = {name for name, f in FORMATS.items() if f.native and f.adaptive is None}
    adaptive = {name for name, f in FORMATS.items() if f.adaptive is not None and f.adaptive.top == "int8"
                and f.adaptive.mid == "int4"}
    assert adaptive == {"ada4_5", "ada4"}
    assert _entry_formats("codec") == native and set(cuda_codec.CUDA_FORMATS) == native | adaptive
    assert _entry_formats("fused") == set(cuda_fused.FORMATS) == {n for n in native if FORMATS[n].scale_kind == "f32"}
    assert all(cuda_codec.supports(f) == (f.name in native or f.name in adaptive) for f in FORMATS.values())
    # the loader serves the generated table for #include "gc_formats.h"
    assert c_header().splitlines()[5] in _loader.source_text("codec")


@pytest.mark.skipif(codec._native is None, reason="the native extension is not built")
def test_native_build_implements_the_native_rows_and_tells_a_stale_one():
    assert codec.native_formats() == frozenset(name for name, f in FORMATS.items() if f.native)
    assert all(codec.native_supports(f) == f.native for f in FORMATS.values())
    assert all(codec.native_supports(f.with_scale_rule("floor")) == f.native
               for f in FORMATS.values() if f.scale_kind == "e8m0")
    # a row whose facts differ from what was compiled (a stale build) is not native
    changed = replace(FORMATS["e5m2"], max_value=1024.0)
    assert not codec.native_supports(changed)


@pytest.fixture
def python_only_format(monkeypatch):
    """A throwaway format in the table only (no C, no CUDA): e4m3's element with another code and
    name, declared reference-only. Removed again by monkeypatch."""
    code = max(FORMATS_BY_CODE) + 1
    f = replace(FORMATS["e4m3"], name="e4m3_pyonly", code=code, native=False)
    monkeypatch.setitem(FORMATS, f.name, f)
    monkeypatch.setitem(FORMATS_BY_CODE, code, f)
    yield f
    codec._native_support.pop(id(f), None)
    codec._native_logged.discard(f.name)
    codec._cuda_fallback_logged.discard(f.name)


def test_python_only_format_runs_on_the_reference(python_only_format, caplog, rng):
    f = python_only_format
    e4m3 = FORMATS["e4m3"]
    assert f.name not in codec.native_formats() and not cuda_codec.supports(f)
    x = (rng.standard_normal(1000) * 3).astype(np.float32)
    local = rng.standard_normal(1000).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="giftcomm"):
        msg = codec.encode(x, f.name, 64)
        # the same bytes as e4m3 (same element, scales, layout), through the reference kernels
        assert np.array_equal(msg, ref.encode(x, e4m3, 64))
        assert np.array_equal(codec.decode(msg, x.size, f.name, 64), ref.decode(msg, x.size, e4m3, 64))
        out = codec.decode_add_encode(msg, local, f.name, 64, sum_out=(s := np.empty(1000, np.float32)))
        assert np.array_equal(out, ref.decode_add_encode(msg, local, e4m3, 64))
        acc = local.copy()
        codec.decode_accumulate(msg, acc, f.name, 64)
        assert np.array_equal(acc, ref.decode(msg, 1000, e4m3, 64) + local) and np.isfinite(s).all()
        sr = codec.encode(x, f.name, 64, rounding="stochastic", key=5, offset=3)
        assert np.array_equal(sr, ref.encode(x, e4m3, 64, rounding="stochastic", key=5, offset=3))
    if codec._native is not None:
        said = [r for r in caplog.records if f.name in r.getMessage()]
        assert len(said) == 1 and "not native" in said[0].getMessage()  # once per format, not per call
    assert message_nbytes(1000, f.name, 64) == message_nbytes(1000, "e4m3", 64)


def test_python_only_format_allreduce(python_only_format, rng):
    f = python_only_format
    p = 3
    xs = [(rng.standard_normal(777) * 2).astype(np.float32) for _ in range(p)]
    for algorithm in ("ring", "direct"):
        outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=f.name, block=32,
                                                              algorithm=algorithm))
        want = simulate_allreduce(xs, fmt="e4m3", block=32, algorithm=algorithm)
        assert all(o.tobytes() == w.tobytes() for o, w in zip(outs, want)), algorithm


def test_scale_rule_variants_share_the_row():
    mx = get_format("mxfp8")
    floor = mx.with_scale_rule("floor")
    assert mx.scale_rule == "ceil" and floor.scale_rule == "floor" and floor.code == mx.code
    assert mx.variant_code == mx.code and floor.variant_code == mx.code | 1 << formats.SCALE_RULE_SHIFT
    assert formats.describe_code(floor.variant_code) == "mxfp8 (mx_scale='floor')"
    assert formats.describe_code(mx.variant_code) == "mxfp8"
    assert get_format("e4m3").with_scale_rule("ceil") is get_format("e4m3")
    with pytest.raises(ValueError, match="E8M0"):
        get_format("e4m3").with_scale_rule("floor")
    with pytest.raises(ValueError, match="mx_scale"):
        mx.with_scale_rule("up")


class _DeviceStandIn(np.ndarray):
    """The two CuPy array methods the device fallback uses (get: a host copy; set: copy in)."""

    def get(self):
        return np.array(self)

    def set(self, host):
        self[...] = host


def test_python_only_format_on_the_device_backend_runs_through_host_copies(python_only_format, caplog, rng):
    f, e4m3 = python_only_format, FORMATS["e4m3"]
    k = codec.CudaOrFallbackKernels
    dev = lambda a: np.array(a).view(_DeviceStandIn)  # noqa: E731
    x = dev((rng.standard_normal(300) * 5).astype(np.float32))
    local = dev(rng.standard_normal(300).astype(np.float32))
    nbytes = message_nbytes(300, e4m3, 32)
    with caplog.at_level(logging.INFO, logger="giftcomm"):
        msg = k.encode(x, f, 32, dev(np.zeros(nbytes, np.uint8)), 7, 11)
        assert np.array_equal(msg, ref.encode(np.asarray(x), e4m3, 32, rounding="stochastic", key=7, offset=11))
        out = k.decode(msg, 300, f, 32, dev(np.zeros(300, np.float32)))
        assert np.array_equal(out, ref.decode(np.asarray(msg), 300, e4m3, 32))
        s = dev(np.zeros(300, np.float32))
        hop = k.decode_add_encode(msg, local, f, 32, dev(np.zeros(nbytes, np.uint8)), s)
        assert np.array_equal(hop, ref.decode_add_encode(np.asarray(msg), np.asarray(local), e4m3, 32))
        acc = k.decode_accumulate(msg, dev(np.asarray(local).copy()), f, 32)
        assert np.array_equal(acc, np.asarray(s))
    assert len([r for r in caplog.records if f.name in r.getMessage() and "CUDA" in r.getMessage()]) == 1


# ---------------------------------------------------------------- a row landing Python-first
@pytest.fixture
def e3m4_row(monkeypatch):
    """A throwaway reference-only row added in this test only: OCP-style FP8 E3M4 elements
    (ml_dtypes.float8_e3m4: 4 mantissa bits, max 15.5, with Inf and NaN, NaN code 0x7F), float32
    block scales, ``native=False``. No other file names it; monkeypatch removes it again."""
    import ml_dtypes

    fi = ml_dtypes.finfo(ml_dtypes.float8_e3m4)
    f = formats.Format("e3m4_try", max(FORMATS_BY_CODE) + 1, np.dtype(ml_dtypes.float8_e3m4), True,
                       float(fi.max), 0x7F, 8, None, "f32", int(fi.maxexp) - 1, native=False)
    monkeypatch.setitem(FORMATS, f.name, f)
    monkeypatch.setitem(FORMATS_BY_CODE, f.code, f)
    yield f
    codec._native_support.pop(id(f), None)
    codec._native_logged.discard(f.name)


def _e3m4_expected(x, f, block):
    """What the wire format's rules (docs/wire-format.md, float32 block scales) make of x:
    per block scale = amax / max and inv = max / amax (float32), codes = the element cast of
    x * inv, decoded value = element value * scale; written out here, not taken from the codec."""
    out = np.empty_like(x)
    for b0 in range(0, x.size, block):
        v = x[b0:b0 + block]
        amax = np.float32(np.abs(v).max())
        fmax = np.float32(f.max_value)
        if amax < f.tiny_amax:
            scale, inv = np.float32(1), np.float32(1)
        else:
            scale, inv = np.float32(amax / fmax), np.float32(fmax / amax)
        y = np.clip((v * inv).astype(np.float32), -fmax, fmax)
        out[b0:b0 + block] = y.astype(f.wire_dtype).astype(np.float32) * scale
    return out


def test_reference_only_row_is_declared_and_left_out_of_the_kernels(e3m4_row):
    f = e3m4_row
    assert not codec.native_supports(f) and f.name not in codec.native_formats()
    assert not cuda_codec.supports(f) and f.name not in cuda_fused.FORMATS
    text = c_header()
    rows = [ln for ln in text.splitlines() if ln.startswith("#define GC_NATIVE_ROWS")]
    assert len(rows) == 1 and "E3M4_TRY" not in rows[0] and "E4M3" in rows[0]
    assert f"#define GC_E3M4_TRY {f.code}\n" in text and "#define GC_E3M4_TRY_ELEM -1\n" in text
    # a row declared native needs an element kind the kernels implement
    with pytest.raises(ValueError, match="native=False"):
        FORMATS[f.name] = replace(f, native=True)
        c_header()


def test_reference_only_row_codec_and_rounding(e3m4_row, rng):
    from giftcomm.reference.codec import element_facts, round_elements

    f = e3m4_row
    assert element_facts(f.wire_dtype) == (4, -2, 8)  # from ml_dtypes.finfo, no hand table
    x = (rng.standard_normal(1000) * np.exp(rng.uniform(-8, 8, 1000))).astype(np.float32)
    x[100:164] = 0.0  # a zero block
    msg = codec.encode(x, f.name, 64)
    assert msg.size == message_nbytes(1000, f.name, 64) == 1000 + 4 * 16
    out = codec.decode(msg, 1000, f.name, 64)
    np.testing.assert_array_equal(out, _e3m4_expected(x, f, 64))
    # nearest rounding of the integer formulation is the ml_dtypes cast for this element too
    y = np.clip(x, -f.max_value, f.max_value)
    assert np.array_equal(round_elements(y, f.wire_dtype), y.astype(f.wire_dtype).view(np.uint8))
    # stochastic: every value decodes to one of the two grid neighbours of x * inv, unbiased on average
    xs = np.full(4096, np.float32(1.03), np.float32)
    xs[0] = 15.5  # amax = max: scale 1, so 1.03 lies between grid points 1.0 and 1.0625
    sr = codec.decode(codec.encode(xs, f.name, 4096, rounding="stochastic", key=3), 4096, f.name, 4096)
    assert set(np.unique(sr[1:]).tolist()) == {1.0, 1.0625}
    assert abs(float(sr[1:].mean()) - 1.03) < 0.003
    # a non-finite block: every element the NaN code, decoded as NaN
    x[5] = np.inf
    assert np.isnan(codec.decode(codec.encode(x, f.name, 64), 1000, f.name, 64)[:64]).all()


def test_reference_only_row_runs_everywhere(e3m4_row, rng):
    """Plain calls (allreduce over several algorithms, reduce_scatter), the simulation, a
    persistent plan and error feedback take the row by name, with the same bytes."""
    from giftcomm.collectives.feedback import own_quantization_error

    f, p, n = e3m4_row, 3, 777
    xs = [(rng.standard_normal(n) * 2).astype(np.float32) for _ in range(p)]
    for algorithm in ("ring", "direct", "oneshot"):
        outs = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=f.name, block=32,
                                                              algorithm=algorithm))
        want = simulate_allreduce(xs, fmt=f.name, block=32, algorithm=algorithm)
        assert all(o.tobytes() == w.tobytes() for o, w in zip(outs, want)), algorithm
        # the row's own element, not e4m3's: 8 bits, but other bytes
        assert not np.array_equal(outs[0], simulate_allreduce(xs, fmt="e4m3", block=32, algorithm=algorithm)[0])
    total = np.sum(xs, axis=0)
    assert np.abs(outs[0] - total).max() < 0.1 * np.abs(total).max()
    shards = gc.LoopbackGroup(p).run(lambda t: gc.reduce_scatter(xs[t.rank], comm=t, fmt=f.name, block=32,
                                                                 algorithm="ring"))
    want = simulate_reduce_scatter(xs, f.name, 32, algorithm="ring")
    assert all(s.tobytes() == w.tobytes() for s, w in zip(shards, want))

    def planned(t):
        plan = gc.plan_allreduce(xs[t.rank], comm=t, fmt=f.name, block=32, algorithm="ring")
        return [plan(xs[t.rank]).copy() for _ in range(2)]

    for per_rank, w in zip(gc.LoopbackGroup(p).run(planned), simulate_allreduce(xs, fmt=f.name, block=32,
                                                                                   algorithm="ring")):
        assert all(o.tobytes() == w.tobytes() for o in per_rank)
    # error feedback: what one-shot sends is each rank's values minus its own encoding error
    sent = [x - own_quantization_error(x, f, 32, None, r) for r, x in enumerate(xs)]
    one = gc.LoopbackGroup(p).run(lambda t: gc.allreduce(xs[t.rank], comm=t, fmt=f.name, block=32,
                                                         algorithm="oneshot"))
    np.testing.assert_allclose(one[0], sent[0] + sent[1] + sent[2], rtol=1e-6, atol=1e-5)


def test_reference_only_row_through_the_adapters(e3m4_row, rng):
    """The torch GradSync (with error feedback) and the JAX allreduce_tree take the row."""
    f, p = e3m4_row, 2
    import torch

    from giftcomm.adapters.torch import GradSync

    def body(t):
        with torch_seeded(0):
            model = torch.nn.Linear(12, 10)
        sync = GradSync(model, comm=t, fmt=f.name, algorithm="oneshot", schedule=GiftSchedule(error_feedback=True))
        g = np.random.default_rng(5 + t.rank)
        grads = [g.standard_normal(q.numel()).astype(np.float32) for q in model.parameters()]
        outs = []
        for _ in range(2):
            sync.zero_grad()
            with torch.no_grad():
                for q, gr in zip(model.parameters(), grads):
                    q.grad.copy_(torch.from_numpy(gr).view_as(q))
            local = np.concatenate(grads)
            sync.sync()
            outs.append((local, np.concatenate([q.grad.numpy().ravel() for q in model.parameters()])))
        return outs

    res = gc.LoopbackGroup(p).run(body)
    exact = (res[0][0][0] + res[1][0][0]) / 2
    assert res[0][0][1].tobytes() == res[1][0][1].tobytes()
    # the first step is the plain average of the row's encodings; the second adds the residuals back
    first = simulate_allreduce([r[0][0] for r in res], fmt=f.name, op="avg", algorithm="oneshot")[0]
    assert res[0][0][1].tobytes() == first.tobytes()
    two = (res[0][0][1] + res[0][1][1]) / 2
    assert np.abs(two - exact).mean() < np.abs(first - exact).mean()
    import jax

    from giftcomm.adapters.jax import allreduce_tree

    trees = [{"w": jax.numpy.asarray(rng.standard_normal((6, 7)).astype(np.float32))} for _ in range(p)]
    outs = gc.LoopbackGroup(p).run(lambda t: allreduce_tree(trees[t.rank], comm=t, fmt=f.name, op="sum",
                                                            algorithm="ring", block=16))
    want = simulate_allreduce([np.asarray(tr["w"]).ravel() for tr in trees], fmt=f.name, block=16, algorithm="ring")
    assert all(np.asarray(o["w"]).ravel().tobytes() == want[0].tobytes() for o in outs)
