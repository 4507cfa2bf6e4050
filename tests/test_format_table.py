"""The format table is the one source of the formats' codes and facts for every language.

- native/gc_formats.h is exactly what giftcomm.formats_header.c_header() makes of the table
  (regenerate with ``python -m giftcomm.formats_header > native/gc_formats.h``);
- no C, CUDA or CUDA-launch source compares a format code with a bare integer;
- the native build and the CUDA kernels report which formats they implement, and a format that
  exists in Python only runs everywhere through the reference kernels (encode/decode, the fused
  hop, an allreduce), with one log line per format.
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import giftcomm as gc
from giftcomm import codec, formats
from giftcomm.cuda import _loader
from giftcomm.cuda import codec as cuda_codec
from giftcomm.formats import FORMATS, FORMATS_BY_CODE, get_format, message_nbytes
from giftcomm.formats_header import HEADER_PATH, c_header, format_facts
from giftcomm.reference import codec as ref
from giftcomm.reference import simulate_allreduce

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


def test_cuda_format_list_matches_the_kernel_entries():
    src = (_loader.KERNEL_DIR / "gc_codec.cu").read_text()
    entries = set(re.findall(r"^GC_(?:BLOCK_SCALED_ENTRIES|PT_ENTRY|MX_ENTRIES)\(.*,\s*(\w+)\)\s*$", src, re.M))
    if re.search(r'extern "C" __global__ .*\bgc_pt_fp32\(', src):
        entries.add("fp32")
    assert entries == set(cuda_codec.CUDA_FORMATS)
    assert set(cuda_codec.CUDA_FORMATS) <= set(FORMATS)
    assert all(cuda_codec.supports(f) for f in FORMATS.values())
    # the loader serves the generated table for #include "gc_formats.h"
    assert c_header().splitlines()[5] in _loader.source_text("codec")


@pytest.mark.skipif(codec._native is None, reason="the native extension is not built")
def test_native_build_implements_every_row_and_tells_a_stale_one():
    assert codec.native_formats() == frozenset(FORMATS)
    assert all(codec.native_supports(f) for f in FORMATS.values())
    assert all(codec.native_supports(f.with_scale_rule("floor")) for f in FORMATS.values() if f.scale_kind == "e8m0")
    # a row whose facts differ from what was compiled (a stale build) is not native
    changed = replace(FORMATS["e5m2"], max_value=1024.0)
    assert not codec.native_supports(changed)


@pytest.fixture
def python_only_format(monkeypatch):
    """A throwaway format in the table only (no C, no CUDA): e4m3's element with another code and
    name. Removed again by monkeypatch."""
    code = max(FORMATS_BY_CODE) + 1
    f = replace(FORMATS["e4m3"], name="e4m3_pyonly", code=code)
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
