"""The C / CUDA view of the format table: ``native/gc_formats.h``, generated from giftcomm.formats.

giftcomm/formats.py is the one source of the formats' codes and facts. The native C codec
(native/*.c, *.h) and the CUDA kernels (giftcomm/cuda/kernels) read them from the header text
:func:`c_header` makes: the C build from the checked-in copy ``native/gc_formats.h``, the CUDA
loader by serving the same text to NVRTC for ``#include "gc_formats.h"`` (giftcomm.cuda._loader).
tests/test_format_table.py regenerates the text and fails when the checked-in copy differs.

Regenerate after changing the table::

    python -m giftcomm.formats_header > native/gc_formats.h
    python -m giftcomm.formats_header --check native/gc_formats.h   # exit 1 when it differs
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import FORMATS, SCALE_RULE_SHIFT, SCALE_RULES, Format

__all__ = ["c_header", "format_facts", "ELEMENT_KINDS", "HEADER_PATH"]

#: the element kinds the C and CUDA kernels implement, by wire dtype: their ``ek``. A native row
#: (Format.native) needs its element here; a reference-only row with another element has kind -1.
ELEMENT_KINDS: dict[str, int] = {"float8_e4m3fn": 0, "float8_e5m2": 1, "float4_e2m1fn": 2}
#: the generated row lists by family (scale kind): what the kernels' dispatch expands
_ROW_LISTS = {"F32": ("f32", "FP8 elements, float32 block scales"),
              "E8M0": ("e8m0", "MX: E8M0 scale per 32 values"),
              "ADAPTIVE": ("adaptive", "adaptive precision: tiers per super-block (the spec registered at run time)")}
_SCALE_KIND_NAMES = {"": "NONE", "f32": "F32", "e8m0": "E8M0", "nvfp4": "NVFP4", "adaptive": "ADAPTIVE"}
HEADER_PATH = "native/gc_formats.h"
"""Where the generated header lives, relative to the repository root (the CUDA loader serves the
same text to NVRTC from :func:`c_header` itself)."""


def _f32_bits(v: float) -> int:
    return int(np.float32(v).view(np.uint32))


def _elem_kind(f: Format) -> int:
    return ELEMENT_KINDS.get(f.wire_dtype.name, -1) if f.scaled else -1


def _rows_macro(name: str, rows: list[Format]) -> str:
    """``#define GC_<name>_ROWS(X) X(NAME, name) ...``: an X-macro over ``rows``."""
    return f"#define GC_{name}_ROWS(X) " + " ".join(f"X({f.name.upper()}, {f.name})" for f in rows)


def format_facts(f: Format) -> str:
    """The facts of one row the kernels compile in, as one string (``GC_<NAME>_FACTS`` in the
    header): the native module reports it for each format it implements, and giftcomm.codec
    runs a format on the reference when the compiled string differs (a stale build)."""
    return (f"{f.name}:{f.code}:{f.scale_kind or 'none'}:{_elem_kind(f)}:{f.value_bits}:{f.itemsize}:"
            f"{f.fixed_block or 0}:{_f32_bits(f.max_value):#x}:{f.nan_code:#x}:{f.emax}")


def _ternary(values: list[int | str], template: str = "{}") -> str:
    """``((ek) == 0 ? v0 : (ek) == 1 ? v1 : v2)`` over the element kinds in order."""
    out = template.format(values[-1])
    for k in range(len(values) - 2, -1, -1):
        out = f"(ek) == {k} ? {template.format(values[k])} : {out}"
    return f"({out})"


def c_header() -> str:
    """The text of ``native/gc_formats.h``: every format code, scale kind, element kind and
    per-format fact of FORMATS as C preprocessor constants (valid C99, C++ and CUDA), a row
    X-macro, and (outside CUDA) a lookup table by code. Deterministic: the check in
    tests/test_format_table.py regenerates it and compares."""
    rows = sorted(FORMATS.values(), key=lambda f: f.code)
    native = [f for f in rows if f.native]
    for f in native:
        if f.scaled and f.adaptive is None and _elem_kind(f) < 0:
            raise ValueError(f"format {f.name} is declared native but the kernels have no element kind for "
                             f"{f.wire_dtype.name} (ELEMENT_KINDS); declare it native=False (reference only)")
    elems = sorted(ELEMENT_KINDS.items(), key=lambda kv: kv[1])
    fins = [ml_dtypes.finfo(np.dtype(getattr(ml_dtypes, name))) for name, _ in elems]
    nan_codes: dict[int, int] = {}
    for f in rows:
        if f.scaled:
            nan_codes.setdefault(_elem_kind(f), f.nan_code if f.scale_kind != "nvfp4" else 0)
    L = [
        "/* gc_formats.h -- GENERATED from giftcomm/formats.py by `python -m giftcomm.formats_header`.",
        " * Do not edit: change the table in giftcomm/formats.py and regenerate",
        " * (python -m giftcomm.formats_header > native/gc_formats.h); tests/test_format_table.py fails",
        " * when this file differs from the table. The CUDA loader serves the same text to NVRTC.",
        " * Valid C99, C++ and CUDA; docs/native.md (the format table) describes the scheme. */",
        "#ifndef GC_FORMATS_H",
        "#define GC_FORMATS_H",
        "",
        "/* format codes: giftcomm.formats.Format.code */",
    ]
    L += [f"#define GC_{f.name.upper()} {f.code}" for f in rows]
    L += [f"#define GC_FORMAT_CODE_LIMIT {rows[-1].code + 1} /* codes are 1 .. GC_FORMAT_CODE_LIMIT - 1 */", ""]
    L += ["/* scale kinds (Format.scale_kind) */"]
    L += [f"#define GC_SCALE_{v} {i}" for i, v in enumerate(_SCALE_KIND_NAMES.values())]
    L += ["", "/* element kinds of the scaled formats (the kernels' `ek`), by element dtype */"]
    L += [f"#define GC_ELEM_{name.split('_')[1].upper().removesuffix('FN')} {k}" for name, k in elems]
    L += ["/* element facts by kind (ek: a constant expression): mantissa bits, exponent of the smallest",
          " * normal, float32 bits of the largest value and their mantissa field, exponent of the largest",
          " * power of two (the MX rules' emax), position of the sign bit, the code of a non-finite block */",
          f"#define GC_ELEM_MANT(ek) {_ternary([fi.nmant for fi in fins])}",
          f"#define GC_ELEM_EMIN(ek) {_ternary([fi.minexp for fi in fins])}",
          f"#define GC_ELEM_MAXB(ek) {_ternary([f'{_f32_bits(float(fi.max)):#010x}u' for fi in fins])}",
          f"#define GC_ELEM_MAXMANT(ek) {_ternary([f'{_f32_bits(float(fi.max)) & 0x7FFFFF:#08x}u' for fi in fins])}",
          f"#define GC_ELEM_EMAX(ek) {_ternary([f'{fi.maxexp - 1}u' for fi in fins])}",
          f"#define GC_ELEM_SBIT(ek) {_ternary([fi.bits - 1 for fi in fins])}",
          f"#define GC_ELEM_NAN(ek) {_ternary([f'{nan_codes.get(k, 0):#04x}u' for _, k in elems])}",
          "",
          "/* shared-exponent rules of the E8M0 formats (giftcomm.formats.SCALE_RULES); a variant code is",
          " * code | rule << GC_SCALE_RULE_SHIFT (Format.variant_code) */"]
    L += [f"#define GC_RULE_{r.upper()} {i}" for i, r in enumerate(SCALE_RULES)]
    L += [f"#define GC_SCALE_RULE_SHIFT {SCALE_RULE_SHIFT}",
          f"#define GC_VARIANT_FORMAT(v) ((v) & {(1 << SCALE_RULE_SHIFT) - 1:#x})",
          "#define GC_VARIANT_RULE(v) ((v) >> GC_SCALE_RULE_SHIFT)",
          "", "/* per-format facts: GC_<NAME>_{SCALE, ELEM, VALUE_BITS, ITEMSIZE, FIXED_BLOCK (0: any), MAX_BITS,",
          " * NAN_CODE, EMAX, FACTS} */"]
    for f in rows:
        n = f"GC_{f.name.upper()}"
        L += [f"#define {n}_SCALE GC_SCALE_{_SCALE_KIND_NAMES[f.scale_kind]}",
              f"#define {n}_ELEM {_elem_kind(f)}",
              f"#define {n}_VALUE_BITS {f.value_bits}",
              f"#define {n}_ITEMSIZE {f.itemsize}",
              f"#define {n}_FIXED_BLOCK {f.fixed_block or 0}",
              f"#define {n}_MAX_BITS {_f32_bits(f.max_value):#010x}u",
              f"#define {n}_NAN_CODE {f.nan_code:#04x}u",
              f"#define {n}_EMAX {f.emax}",
              f'#define {n}_FACTS "{format_facts(f)}"']
    L += ["", "/* the rows the C and CUDA kernels implement (Format.native), all and by family, in code order:",
          " * X(NAME, name) per row; the kernels' dispatch switches and CUDA entry points expand these */",
          _rows_macro("NATIVE", native)]
    for macro, (kind, words) in _ROW_LISTS.items():
        L += [f"/* {words} */", _rows_macro(macro, [f for f in native if f.scale_kind == kind])]
    L += ["", "/* the same facts by code (c: any int expression; an unknown code gives 0 / -1) */"]
    for macro, fact in (("SCALE", "SCALE"), ("ELEM", "ELEM"), ("VALUE_BITS", "VALUE_BITS"), ("ITEMSIZE", "ITEMSIZE"),
                        ("FIXED_BLOCK", "FIXED_BLOCK")):
        chain = "0" if macro != "ELEM" else "-1"
        for f in reversed(rows):
            chain = f"(c) == GC_{f.name.upper()} ? GC_{f.name.upper()}_{fact} : {chain}"
        L.append(f"#define GC_FMT_{macro}(c) ({chain})")
    L += ["", "#ifndef __CUDACC__",
          "/* one row by code (host C and C++): name, facts string; NULL for a code no format has */",
          "typedef struct {",
          "    const char *name, *facts;",
          "    int code, scale, elem, value_bits, itemsize, fixed_block;",
          "} gc_format_row;",
          "",
          "static inline const gc_format_row *gc_format_row_of(int code)",
          "{",
          "    static const gc_format_row rows[] = {"]
    L += [f'        {{"{f.name}", GC_{f.name.upper()}_FACTS, GC_{f.name.upper()}, GC_{f.name.upper()}_SCALE, '
          f"GC_{f.name.upper()}_ELEM, GC_{f.name.upper()}_VALUE_BITS, GC_{f.name.upper()}_ITEMSIZE, "
          f"GC_{f.name.upper()}_FIXED_BLOCK}}," for f in rows]
    L += ["    };",
          "    for (unsigned i = 0; i < sizeof rows / sizeof rows[0]; i++)",
          "        if (rows[i].code == code)",
          "            return &rows[i];",
          "    return 0;",
          "}",
          "#endif", "", "#endif", ""]
    return "\n".join(L)


def _main(argv: list[str]) -> int:
    import sys
    from pathlib import Path

    if not argv:
        sys.stdout.write(c_header())
        return 0
    if len(argv) == 2 and argv[0] == "--check":
        path = Path(argv[1])
        if not path.is_file() or path.read_text() != c_header():
            print(f"{path} differs from giftcomm/formats.py; regenerate: python -m giftcomm.formats_header > {path}",
                  file=sys.stderr)
            return 1
        return 0
    print("usage: python -m giftcomm.formats_header [--check native/gc_formats.h]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(__import__("sys").argv[1:]))
