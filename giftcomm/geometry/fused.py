"""The GIFT low-rank transform fused into the e4m3/e5m2 codec on the device (kernels/gc_fused.cu;
design: docs/gpu.md "Fused transform"; host model of the same operation order:
giftcomm.geometry.fused_model).

:class:`FusedPlan` (one Geometry, one direction, one CuPy-like backend) uploads its parameter
pool and piece table once and keeps every work buffer, so a call allocates nothing:

- ``project(x)``: pass A (``P = X U_R``, ``Q = U_L^T X``; one batched launch per projection and
  shape group, segments of equal shape together) and pass S (the small factors) from a float32
  buffer ``x`` (N,);
- ``project_wire(wire, fmt, block, table=None)``: the same from a block-scaled wire of all N
  values (decoded on the fly): one message (``table`` None), or the messages of a
  :class:`WireTable` (the ring allgather's slices of every chunk, back to back);
- ``encode(x, lo, count, fmt, block, message)``: the wire message of ``Y[lo:lo+count]``, the
  transformed values computed from ``x`` and the projections (Y is never written);
  ``decode_add_encode(x, lo, count, message_in, ...)``: one ring hop, ``encode(decode(in) + Y[lo:...])``;
- ``decode(wire, fmt, block, out, divisor=None, table=None)``: ``out = inverse-update(decode(wire))``
  (``/ divisor`` after it, op="avg"), after ``project_wire`` of the same wire: the
  "inverse plan" (``inverse=True``) is the one to use;
- ``values(x, lo, count, out)``: ``Y[lo:lo+count]`` as float32 (after ``project``; direct's owner
  adds its own values unquantized);
- ``apply(x, out)``: the transform of a float32 buffer (for direct's and oneshot's float32 sums).

Verified (emulator, tests/test_fused_emulated.py): every kernel bit for bit against the host
model and within the stated bound of giftcomm.geometry + giftcomm.reference; not run on a GPU.
Formats: e4m3 and e5m2, nearest rounding, block <= 256 (the team path); ``encode`` and
``decode_add_encode`` also fp32 pass-through (the hierarchical algorithms' node-local ring);
others raise ValueError.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..cuda import _loader
from ..formats import FORMATS as _TABLE
from ..formats import Format, num_blocks, scales_offset
from .fused_model import FusedLayout

__all__ = ["FusedPlan", "WireTable", "wire_table", "FORMATS", "MAX_BLOCK"]

#: the formats gc_fused.cu has kernels for: the native FP8 rows with float32 scales (its entries
#: expand GC_F32_ROWS of the generated gc_formats.h)
FORMATS = tuple(f.name for f in _TABLE.values() if f.native and f.scale_kind == "f32")
MAX_BLOCK = 256
_THREADS = 256
_NULL = np.uint64(0)
MAX_GRID = 1 << 16  # CTAs per launch (grid-stride loops beyond); tests lower it


def _fn(name: str) -> Any:
    return _loader.get_function(name, "fused")


def _grid(items: int) -> int:
    return max(1, min(-(-items // _THREADS), MAX_GRID))


def _team_width(block: int) -> int:
    g = 1
    while g * 8 < block:
        g *= 2
    return g


def _check_format(f: Format, block: int) -> None:
    if f.name not in FORMATS or block > MAX_BLOCK:
        raise ValueError(f"the fused GIFT codec supports {', '.join(FORMATS)} at block <= {MAX_BLOCK}, "
                         f"got {f.name} block {block}")


class WireTable:
    """Where each message of a wire lies (gc_fused.cu's ``mtab``): ``table`` (3 NM + 1 int64, on
    the device) and ``nm``. Made once per layout by :func:`wire_table` and kept by its user."""

    __slots__ = ("table", "nm", "size")

    def __init__(self, table: Any, nm: int, size: int) -> None:
        self.table, self.nm, self.size = table, nm, size


def wire_table(xp: Any, starts: Any, byte_offsets: Any, f: Format, block: int) -> WireTable:
    """The table of messages covering element ranges ``starts[k]:starts[k+1]`` (NM + 1 ints, each
    range whole scale blocks of the buffer but the last) at ``byte_offsets[k]`` (NM ints) of the
    wire buffer, each laid out as giftcomm.formats says (payload, then its scales)."""
    st = np.asarray(starts, np.int64)
    nm = st.size - 1
    if nm < 1 or np.any(np.diff(st) <= 0) or st[0] != 0:
        raise ValueError("a wire table needs at least one message and increasing element starts from 0")
    pay = np.asarray(byte_offsets, np.int64)
    sc = np.array([scales_offset(int(b - a), f) for a, b in zip(st[:-1], st[1:])], np.int64) + pay
    if np.any(sc % 4):
        raise ValueError("every message's scales must be 4-byte aligned in the wire buffer")
    return WireTable(xp.asarray(np.concatenate([st, pay, sc])), nm, int(st[-1]))


class FusedPlan:
    """The fused transform of ``geometry`` (forward, or ``inverse=True``) on backend ``xp``."""

    def __init__(self, geometry: Any, xp: Any, inverse: bool = False) -> None:
        self.xp, self.inverse = xp, inverse
        self.layout = lay = FusedLayout.build(geometry, inverse)
        self.size = lay.size
        self.pool = xp.asarray(lay.pool)
        self.pstart = xp.asarray(lay.pstart)
        self.rec = xp.asarray(lay.rec)
        self.pcc = xp.asarray(lay.pcc)
        self._groups = []
        for g in lay.groups:
            views = {name: lay.view(self.pool, g, name) for name in g.shapes()}
            self._groups.append((g, xp.asarray(g.starts), views))
        self._table = (self.pstart, self.rec, self.pcc, self.pool, np.int32(lay.npieces))
        self._one: dict[tuple[str, int], WireTable] = {}  # the one-message wire table per (fmt, block)

    # ---- passes A and S
    def _project(self, suffix: str, head: tuple) -> None:
        for g, starts, v in self._groups:
            b, m, n = np.int32(g.b), np.int32(g.m), np.int32(g.n)
            if g.kr:
                _fn(f"gc_fz_proj_p_{suffix}")((_grid(32 * g.b * g.m),), (_THREADS,),
                                              head + (starts, v["ur"], v["P"], b, m, n, np.int32(g.kr)))
            if g.kl:
                tiles = -(-g.kl // 8)
                _fn(f"gc_fz_proj_q_{suffix}")((_grid(g.b * tiles * g.n),), (_THREADS,),
                                              head + (starts, v["ul"], v["Q"], b, m, n, np.int32(g.kl)))
            if g.kr:
                _fn("gc_fz_small")((_grid(g.b * (g.kl * g.kr + g.m * g.kr)),), (_THREADS,),
                                   (v["P"], v["ul"], v["ldr"], v["dldr"], v["Wd"], v["L1"], b, m,
                                    np.int32(g.kl), np.int32(g.kr)))
            if g.kl:
                _fn("gc_fz_r2")((_grid(g.b * g.n * g.kl),), (_THREADS,),
                                (v["Q"], v["ur"], v["rdl"], v["Wd"], v["R2t"], b, n, np.int32(g.kl), np.int32(g.kr)))

    def _flat(self, x: Any) -> Any:
        if x.dtype != np.float32 or x.ndim != 1 or x.size != self.size or not x.flags.c_contiguous:
            raise ValueError(f"the fused transform needs a contiguous float32 (N={self.size},) buffer, "
                             f"got {x.dtype} {x.shape}")
        return x

    def project(self, x: Any) -> None:
        """Passes A and S from the float32 buffer ``x`` (N,)."""
        self._project("f32", (self._flat(x),))

    def _parts(self, message: Any, count: int, f: Format, block: int) -> tuple[Any, Any]:
        off = scales_offset(count, f)
        return message[:count], message[off : off + 4 * num_blocks(count, block)].view(np.float32)

    def _wire(self, message: Any, f: Format, block: int, table: WireTable | None) -> tuple:
        _check_format(f, block)
        if table is None:  # one message of all N values; its table is made once per (fmt, block)
            table = self._one.get((f.name, block))
            if table is None:
                table = self._one[(f.name, block)] = wire_table(self.xp, [0, self.size], [0], f, block)
        if table.size != self.size:
            raise ValueError(f"the wire covers {table.size} values, the plan {self.size}")
        return (message, table.table, np.int32(table.nm), np.int32(block))

    def project_wire(self, message: Any, f: Format, block: int, table: WireTable | None = None) -> None:
        """Passes A and S from a wire of all N values: one message, or ``table``'s messages."""
        self._project(f.name, self._wire(message, f, block, table))

    # ---- fused codec
    def _enc(self, kind: str, x: Any, lo: int, count: int, f: Format, block: int, message: Any,
             head: tuple, y_out: Any) -> Any:
        _check_format(f, block)
        if lo < 0 or lo + count > self.size:
            raise ValueError(f"range [{lo}, {lo + count}) outside the buffer of {self.size}")
        nb = num_blocks(count, block)
        pay, sc = self._parts(message, count, f, block)
        G = _team_width(block)
        _fn(f"gc_fz_{kind}_{f.name}")(
            (max(1, min(-(-nb // (_THREADS // G)), MAX_GRID)),), (_THREADS,),
            (self._flat(x), np.int64(lo)) + head + (pay, sc, _NULL if y_out is None else y_out, np.int64(count),
                                                    np.int32(block), np.int64(nb), np.int32(G),
                                                    np.int32(scales_offset(count, f) - count)) + self._table)
        return message

    def _pt(self, kind: str, x: Any, lo: int, count: int, head: tuple, message: Any, y_out: Any) -> Any:
        """fp32 pass-through: the message is the float32 values (the hierarchical node ring)."""
        if lo < 0 or lo + count > self.size:
            raise ValueError(f"range [{lo}, {lo + count}) outside the buffer of {self.size}")
        if count:
            _fn(f"gc_fz_{kind}_fp32")((_grid(count),), (_THREADS,),
                                      (self._flat(x), np.int64(lo)) + head
                                      + (message[: 4 * count].view(np.float32), _NULL if y_out is None else y_out,
                                         np.int64(count)) + self._table)
        return message

    def encode(self, x: Any, lo: int, count: int, f: Format, block: int, message: Any, y_out: Any = None) -> Any:
        """Wire message of ``Y[lo:lo+count]`` (after :meth:`project` of the same ``x``); fp32 too."""
        if f.name == "fp32":
            return self._pt("enc", x, lo, count, (), message, y_out)
        return self._enc("enc", x, lo, count, f, block, message, (), y_out)

    def decode_add_encode(self, x: Any, lo: int, count: int, message_in: Any, f: Format, block: int,
                          message: Any, y_out: Any = None) -> Any:
        """One ring hop: ``encode(decode(message_in) + Y[lo:lo+count])`` (float32 sum); fp32 too."""
        if f.name == "fp32":
            return self._pt("dae", x, lo, count, (message_in[: 4 * count].view(np.float32),), message, y_out)
        pin, sin = self._parts(message_in, count, f, block)
        return self._enc("dae", x, lo, count, f, block, message, (pin, sin), y_out)

    def decode(self, message: Any, f: Format, block: int, out: Any, divisor: float | None = None,
               table: WireTable | None = None) -> Any:
        """``out`` (N,) float32 = the update of the decoded wire (then ``/ divisor``), after
        :meth:`project_wire` of the same wire (one message, or ``table``'s)."""
        head = self._wire(message, f, block, table)
        _fn(f"gc_fz_dec_{f.name}")((_grid(self.size),), (_THREADS,),
                                   head + (self._flat(out), np.int64(self.size), np.float32(divisor or 1.0),
                                           np.int32(divisor is not None)) + self._table)
        return out

    def values(self, x: Any, lo: int, count: int, out: Any) -> Any:
        """``out`` (count,) float32 = ``Y[lo:lo+count]`` (after :meth:`project` of the same ``x``)."""
        if lo < 0 or lo + count > self.size or out.dtype != np.float32 or out.size != count:
            raise ValueError(f"range [{lo}, {lo + count}) of {self.size} into a float32 ({count},) buffer")
        if count:
            _fn("gc_fz_apply_f32")((_grid(count),), (_THREADS,),
                                   (self._flat(x), out, np.int64(lo), np.int64(count), np.float32(1.0), np.int32(0))
                                   + self._table)
        return out

    def apply(self, x: Any, out: Any, divisor: float | None = None) -> Any:
        """``out`` = the transform of float32 ``x`` (passes A, S and the update; ``/ divisor``)."""
        self.project(x)
        _fn("gc_fz_apply_f32")((_grid(self.size),), (_THREADS,),
                               (self._flat(x), self._flat(out), np.int64(0), np.int64(self.size),
                                np.float32(divisor or 1.0), np.int32(divisor is not None)) + self._table)
        return out
