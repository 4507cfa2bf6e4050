"""Device benchmark (one CUDA GPU, CuPy): how close giftcomm's GPU codec and transform come to
line rate.

``python -m giftcomm.perf device [--quick] [--out FILE.md] [--json FILE.json]`` prints Markdown:

1. the device-to-device copy roofline (``cupy.copyto``, read + write bytes / time);
2. codec GB/s and % of that roofline for every scaled format (e4m3 and e5m2 at blocks
   16..1024, 8192 and 16384: every kernel path, the two-pass one of encode above 4096 and of
   decode_add_encode above 8192; the MX formats and nvfp4 at their own block), for encode,
   decode, decode_add_encode (no sum_out), decode_accumulate, and encode / decode_add_encode
   with stochastic rounding (ops ``encode_sr``, ``decode_add_encode_sr``). The bytes counted
   are the bytes each op must move (float32 in/out, the wire message in/out): encode 4 +
   w, decode w + 4, decode_add_encode w + 4 + w, decode_accumulate w + 4 + 4 per value, where
   w = message_nbytes / count. The two-pass path reads its input twice; it is still counted once;
3. the per-256-block E4M3 cast a PyTorch user would write (amax per block, divide,
   ``.to(torch.float8_e4m3fn)``; decode: multiply back; the ring hop: decode, add, encode)
   under ``torch.compile`` and eager, next to giftcomm's e4m3 block-256 encode, decode and
   decode_add_encode;
4. the geometry transform: forward + inverse of one Llama-like layer (hidden 1024, MLP 2816:
   q, k, v, o, gate, up, down; 12.8M values) with a low-rank KFAC geometry (rank --rank), the
   unfused route (``Geometry.forward`` / ``inverse``: cuBLAS and CuPy elementwise);
5. section ``gift``, the targets of the fused transform (giftcomm.geometry.fused; docs/gpu.md
   "Fused transform") on that layer, e4m3 block 256, each with its verdict:
   - device compute of one ring per rank (encode + decode_add_encode + decode of the buffer):
     GIFT fused (pass A, fused encode, fused hop, inverse pass A from the wire, fused inverse
     decode) against the plain FP8 codec (target <= 1.5x);
   - forward + inverse alone (the fused kernels' transform of a float32 buffer, Y written)
     against the HBM floor, one read + one write per direction (target >= 50%, <= ~0.1 ms);
   - gift_allreduce against plain allreduce over ``DeviceLoopbackGroup(1)`` (wall time), and
     the relative difference of its result from the unfused route's (a sanity check);
6. the projected step at 100/200/400 Gbit/s per GPU, nothing overlapped: FP8 ring wire time
   (2x the message) plus the compute, against bf16's wire time: GIFT's net saving.

Timing: CUDA events, median of --reps after --warmup calls. The Markdown and JSON files are
rewritten after every section, so a run cut short keeps what it measured. Without a CUDA GPU the
command exits with status 2 and says so. The formatting is plain functions of timing dicts (tested on CPU
with fake timings: tests/test_gpu_plumbing.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..formats import Format, get_format, message_nbytes, resolve_block
from .timing import time_calls

SCALED_BLOCKS = (16, 32, 64, 128, 256, 512, 1024, 8192, 16384)
FP8_FORMATS = ("e4m3", "e5m2")
MX_FORMATS = ("mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4")
OPS = ("encode", "decode", "decode_add_encode", "decode_accumulate", "encode_sr", "decode_add_encode_sr")
#: largest e4m3/e5m2 block of the one-pass kernels per op (giftcomm.cuda.codec CTA_MAX_BLOCK,
#: DAE_CTA_MAX_BLOCK); above it the two-pass path
ONE_PASS_MAX_BLOCK = {"encode": 4096, "decode_add_encode": 8192}
LINK_GBITS = (100, 200, 400)
#: one Llama-like layer: (name, (rows, cols)) of its weight matrices (hidden 1024, MLP 2816)
LLAMA_LAYER = tuple((n, s) for n, s in (("q", (1024, 1024)), ("k", (1024, 1024)), ("v", (1024, 1024)),
                                        ("o", (1024, 1024)), ("gate", (2816, 1024)), ("up", (2816, 1024)),
                                        ("down", (1024, 2816))))
NO_GPU_EXIT = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m giftcomm.perf device", description=__doc__.splitlines()[0])
    ap.add_argument("--log2n", type=int, default=26, help="values per codec call: 2^N (default 26: 256 MiB float32)")
    ap.add_argument("--blocks", default=",".join(map(str, SCALED_BLOCKS)), help="e4m3/e5m2 block sizes")
    ap.add_argument("--formats", default=",".join(FP8_FORMATS + MX_FORMATS), help="scaled formats")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rank", type=int, default=32, help="low-rank KFAC rank k of the transform section")
    ap.add_argument("--sections", default="codec,torch,transform,gift",
                    help="comma list of codec, torch, transform, gift")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (eager peer only)")
    ap.add_argument("--quick", action="store_true", help="2^24 values, 5 reps (a smoke run)")
    ap.add_argument("--out", help="also write the Markdown report to this file")
    ap.add_argument("--json", help="write the raw timings (ms) to this JSON file")
    a = ap.parse_args(argv)
    if a.quick:
        a.log2n, a.reps = min(a.log2n, 24), min(a.reps, 5)
    a.blocks = [int(b) for b in a.blocks.split(",") if b]
    a.formats = [f for f in a.formats.split(",") if f]
    a.sections = [s for s in a.sections.split(",") if s]
    for f in a.formats:
        if not get_format(f).scaled:
            ap.error(f"{f} is not a scaled format")
    bad = set(a.sections) - {"codec", "torch", "transform", "gift"}
    if bad:
        ap.error(f"unknown section(s): {', '.join(sorted(bad))}")
    if not 10 <= a.log2n <= 31:
        ap.error("--log2n must be in 10..31")
    return a


# ------------------------------------------------------------------------ byte accounting
def wire_bytes_per_value(fmt: Format, block: int | None, n: int) -> float:
    return message_nbytes(n, fmt, resolve_block(fmt, block)) / n


def bytes_per_value(op: str, fmt: Format, block: int | None, n: int) -> float:
    """Bytes an op must move per value: float32 reads/writes plus wire message reads/writes
    (the stochastic ops ``*_sr`` move what their nearest twins move)."""
    w = wire_bytes_per_value(fmt, block, n)
    return {"encode": 4 + w, "decode": w + 4, "decode_add_encode": w + 4 + w,
            "decode_accumulate": w + 8}[op.removesuffix("_sr")]


def two_pass(op: str, fmt: Format, block: int) -> bool:
    """Whether the e4m3/e5m2 ``op`` at ``block`` runs the two-pass kernels (its input read twice)."""
    limit = ONE_PASS_MAX_BLOCK.get(op.removesuffix("_sr"))
    return fmt.scale_kind == "f32" and limit is not None and block > limit


def codec_cases(formats: list[str], blocks: list[int]) -> list[tuple[str, int | None]]:
    """(fmt, block) pairs: e4m3/e5m2 at every block, MX formats / nvfp4 at their own (None)."""
    out: list[tuple[str, int | None]] = []
    for f in formats:
        if get_format(f).scale_kind == "f32":
            out += [(f, b) for b in blocks]
        else:
            out.append((f, None))
    return out


# ------------------------------------------------------------------------------ formatting
def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def format_copy(copy_ms: float, nbytes: int) -> tuple[float, str]:
    gbs = 2 * nbytes / copy_ms / 1e6
    return gbs, f"device-to-device copy of {nbytes / 2**20:.0f} MiB: {copy_ms:.3f} ms = **{gbs:.0f} GB/s** (read + write)"


def format_codec_table(times: dict[tuple[str, int | None, str], float], n: int, copy_gbs: float) -> str:
    """times: (fmt, block, op) -> ms for n values."""
    lines = ["| fmt | block | op | ms | Gvalues/s | bytes/value | GB/s | % of copy roofline |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (fmt, block, op), ms in times.items():
        f = get_format(fmt)
        bpv = bytes_per_value(op, f, block, n)
        gbs = bpv * n / ms / 1e6
        shown = block if block is not None else resolve_block(f, None)
        lines.append(f"| {fmt} | {shown}{' (two-pass)' if two_pass(op, f, shown) else ''} | {op} | {ms:.3f} | "
                     f"{n / ms / 1e6:.1f} | {bpv:.3f} | {gbs:.0f} | {_pct(gbs / copy_gbs)} |")
    return "\n".join(lines)


def format_peer_table(peer: dict[str, float], n: int, copy_gbs: float) -> str:
    """peer: 'giftcomm encode', 'torch.compile encode', 'eager encode', same for decode and
    decode_add_encode -> ms."""
    lines = ["| implementation | op | ms | GB/s | % of copy roofline | giftcomm speed relative to it |",
             "| --- | --- | --- | --- | --- | --- |"]
    for op in ("encode", "decode", "decode_add_encode"):
        g = peer.get(f"giftcomm {op}")
        for impl in ("giftcomm", "torch.compile", "eager"):
            ms = peer.get(f"{impl} {op}")
            if ms is None:
                continue
            gbs = bytes_per_value(op, get_format("e4m3"), 256, n) * n / ms / 1e6
            rel = f"{ms / g:.2f}x" if g else "-"
            lines.append(f"| {impl} | {op} | {ms:.3f} | {gbs:.0f} | {_pct(gbs / copy_gbs)} | {rel} |")
    return "\n".join(lines)


def layer_values(layout=LLAMA_LAYER) -> int:
    return int(sum(np.prod(s) for _, s in layout))


def format_transform(fwd_ms: float, inv_ms: float, n: int, rank: int, copy_gbs: float) -> str:
    floor_ms = 2 * 2 * 4 * n / (copy_gbs * 1e6)  # read + write float32 once per direction
    tot = fwd_ms + inv_ms
    return (f"one Llama-like layer ({n / 1e6:.1f}M values, {len(LLAMA_LAYER)} segments), low-rank KFAC k={rank}: "
            f"forward {fwd_ms:.3f} ms, inverse {inv_ms:.3f} ms, forward + inverse **{tot:.3f} ms** = "
            f"{tot / floor_ms:.1f}x the HBM floor ({floor_ms:.3f} ms: one read + one write per direction at the copy "
            f"roofline; target <= 2x, i.e. >= 50% of the roofline)")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def format_gift(g: dict[str, float], n: int, copy_gbs: float, links=LINK_GBITS) -> str:
    """The fused transform's targets. g (ms): 'plain_codec' and 'gift_codec' (one ring's device
    compute per rank, without and with GIFT), 'forward' and 'inverse' (the fused transform
    alone), 'gift' and 'plain' (gift_allreduce / allreduce wall time over one loopback rank);
    optional 'diff' (relative difference of the fused result from the unfused route's)."""
    msg = message_nbytes(n, get_format("e4m3"), 256)
    ratio = g["gift_codec"] / g["plain_codec"]
    tr = g["forward"] + g["inverse"]
    floor_ms = 2 * 2 * 4 * n / (copy_gbs * 1e6)
    lines = [f"- device compute of one ring per rank: GIFT fused {g['gift_codec']:.3f} ms, plain FP8 "
             f"{g['plain_codec']:.3f} ms: **{ratio:.2f}x** (target <= 1.5x: {_verdict(ratio <= 1.5)})",
             f"- forward + inverse alone (fused kernels): {g['forward']:.3f} + {g['inverse']:.3f} = **{tr:.3f} ms**, "
             f"{_pct(floor_ms / tr)} of the HBM roofline ({floor_ms:.3f} ms: one read + one write per direction; "
             f"target >= 50%: {_verdict(floor_ms / tr >= 0.5)})",
             f"- gift_allreduce (DeviceLoopbackGroup(1), wall): {g['gift']:.3f} ms; plain FP8 allreduce: "
             f"{g['plain']:.3f} ms ({g['gift'] / g['plain']:.2f}x)"]
    if "diff" in g:
        lines.append(f"- fused result vs the unfused route's: relative difference {g['diff']:.2e} "
                     f"(both quantize to e4m3 once: of the order of the FP8 error or below)")
    lines += ["",
              "| link Gbit/s | FP8 ring wire ms | bf16 ring wire ms | plain FP8 step ms | GIFT step ms | "
              "GIFT compute share of its step | GIFT step / bf16 | GIFT net saving vs bf16 ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for gb in links:
        fp8 = 2 * msg * 8 / (gb * 1e9) * 1e3
        bf = 2 * 2 * n * 8 / (gb * 1e9) * 1e3
        step = fp8 + g["gift_codec"]
        lines.append(f"| {gb} | {fp8:.3f} | {bf:.3f} | {fp8 + g['plain_codec']:.3f} | {step:.3f} | "
                     f"{_pct(g['gift_codec'] / step)} | {step / bf:.2f} | {bf - step:.3f} |")
    lines.append("\nRing wire time: 2x the message per GPU (2(P-1)/P at large P); nothing overlapped (a step is "
                 "wire + compute); bf16 is the uncompressed alternative, its compute taken as zero.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ measuring
def event_timer(cp: Any, warmup: int, reps: int, wall: bool = False, calls: int = 8) -> Callable[[Callable[[], Any]], float]:
    """A function timing ``fn()`` on the device: ``warmup`` calls, then the median of ``reps``
    timings in milliseconds per call. Each timing is ``calls`` back-to-back calls between one pair
    of CUDA events, divided by ``calls``: the device stays busy while the host queues the next
    launch, so the host's launch gap between calls is not counted (one call per event pair counts
    it once per call: up to ~20-30% at 2^26 values). With ``wall``: the host's clock from before
    the first call until the device is synchronized after the last (launch gaps included: what a
    caller waits)."""
    def clock(run: Callable[[], Any]) -> tuple[float, Any]:
        cp.cuda.Device().synchronize()  # the warm-up's (or the previous repeat's) work is done
        a, b, t0 = cp.cuda.Event(), cp.cuda.Event(), time.perf_counter()
        a.record()
        result = run()
        b.record()
        (cp.cuda.Device() if wall else b).synchronize()
        return (time.perf_counter() - t0 if wall else 1e-3 * cp.cuda.get_elapsed_time(a, b)), result

    return lambda fn: 1e3 * time_calls(fn, reps, warmup=warmup, calls=calls, clock=clock)[0]


def measure_codec(cp: Any, timed, n: int, cases, on_case: Callable[[dict], None] | None = None) -> dict:
    """(fmt, block, op) -> ms for n values; ``on_case(results so far)`` after each (fmt, block)."""
    from .. import codec as gc

    x = cp.random.standard_normal(n, dtype=cp.float32)
    local = cp.random.standard_normal(n, dtype=cp.float32)
    dec = cp.empty(n, cp.float32)
    res = {}
    for fmt, block in cases:
        kw = {} if block is None else {"block": block}
        msg = gc.encode(x, fmt, **kw)
        out = cp.empty_like(msg)
        sr = {"rounding": "stochastic", "key": 0x5EED, **kw}
        fns = {"encode": lambda: gc.encode(x, fmt, out=out, **kw),
               "decode": lambda: gc.decode(msg, n, fmt, out=dec, **kw),
               "decode_add_encode": lambda: gc.decode_add_encode(msg, local, fmt, out=out, **kw),
               "decode_accumulate": lambda: gc.decode_accumulate(msg, dec, fmt, **kw),
               "encode_sr": lambda: gc.encode(x, fmt, out=out, **sr),
               "decode_add_encode_sr": lambda: gc.decode_add_encode(msg, local, fmt, out=out, **sr)}
        for op in OPS:
            res[(fmt, block, op)] = timed(fns[op])
        if on_case is not None:
            on_case(res)
    return res


def measure_torch_peer(cp: Any, timed, n: int, compile_: bool) -> dict:
    import torch

    from .. import codec as gc

    x = torch.randn(n, device="cuda", dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny

    def enc(v):
        b = v.view(-1, 256)
        scale = (b.abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(tiny)
        return (b / scale).to(torch.float8_e4m3fn), scale

    def dec(q, scale):
        return (q.to(torch.float32) * scale).view(-1)

    res = {}
    xc = cp.from_dlpack(x)
    msg = gc.encode(xc, "e4m3", 256)
    out = cp.empty_like(msg)
    dout = cp.empty(n, cp.float32)
    res["giftcomm encode"] = timed(lambda: gc.encode(xc, "e4m3", 256, out=out))
    res["giftcomm decode"] = timed(lambda: gc.decode(msg, n, "e4m3", 256, out=dout))
    local = torch.randn(n, device="cuda", dtype=torch.float32)
    lc = cp.from_dlpack(local)
    res["giftcomm decode_add_encode"] = timed(lambda: gc.decode_add_encode(msg, lc, "e4m3", 256, out=out))

    def hop(q, scale, v):
        return enc(dec(q, scale) + v)

    q, s = enc(x)
    res["eager encode"] = timed(lambda: enc(x))
    res["eager decode"] = timed(lambda: dec(q, s))
    res["eager decode_add_encode"] = timed(lambda: hop(q, s, local))
    if compile_:
        cenc, cdec, chop = torch.compile(enc), torch.compile(dec), torch.compile(hop)
        res["torch.compile encode"] = timed(lambda: cenc(x))
        res["torch.compile decode"] = timed(lambda: cdec(q, s))
        res["torch.compile decode_add_encode"] = timed(lambda: chop(q, s, local))
    return res


def llama_layer_geometry(rank: int, seed: int = 0):
    """A low-rank KFAC geometry of LLAMA_LAYER: each factor's spectrum geometric from 1 to 1e-3
    (unit mean) with random orthonormal top-``rank`` eigenvectors (only those are needed, so no
    d x d eigendecomposition: seconds on a CPU)."""
    from ..geometry import Geometry
    from ..geometry.spectral import Spectrum

    rng = np.random.default_rng(seed)
    cache: dict[int, Spectrum] = {}

    def spectrum(d: int) -> Spectrum:
        if d not in cache:
            values = np.geomspace(1, 1e-3, d)
            vectors, _ = np.linalg.qr(rng.standard_normal((d, min(rank, d))))
            cache[d] = Spectrum(values / values.mean(), vectors, 1.0)
        return cache[d]

    factors = {name: (spectrum(s[1]), spectrum(s[0])) for name, s in LLAMA_LAYER}
    return Geometry.from_kfac(list(LLAMA_LAYER), factors, rank=rank)


def measure_transform(cp: Any, timed, geometry) -> dict:
    x = cp.random.standard_normal(geometry.size, dtype=cp.float32)
    y = geometry.forward(x)
    return {"forward": timed(lambda: geometry.forward(x)), "inverse": timed(lambda: geometry.inverse(y))}


def measure_gift(cp: Any, timed, wall, geometry) -> dict:
    """The fused transform's timings on ``geometry`` (format_gift's keys)."""
    import giftcomm
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    from .. import codec as gc
    from ..geometry.fused import FusedPlan

    n, f = geometry.size, get_format("e4m3")
    x = cp.random.standard_normal(n, dtype=cp.float32)
    fwd, inv = FusedPlan(geometry, cp), FusedPlan(geometry, cp, inverse=True)
    msg = gc.encode(x, "e4m3", 256)
    out = cp.empty_like(msg)
    y, z = cp.empty(n, cp.float32), cp.empty(n, cp.float32)

    def plain_codec():
        gc.encode(x, "e4m3", 256, out=out)
        gc.decode_add_encode(msg, x, "e4m3", 256, out=out)
        gc.decode(out, n, "e4m3", 256, out=z)

    def gift_codec():
        fwd.project(x)
        fwd.encode(x, 0, n, f, 256, out)
        fwd.decode_add_encode(x, 0, n, msg, f, 256, out)
        inv.project_wire(out, f, 256)
        inv.decode(out, f, 256, z)

    res = {"plain_codec": timed(plain_codec), "gift_codec": timed(gift_codec),
           "forward": timed(lambda: fwd.apply(x, y)), "inverse": timed(lambda: inv.apply(y, z))}
    grp = DeviceLoopbackGroup(1)
    fused = grp.run(lambda t: giftcomm.gift_allreduce(x, geometry, comm=t, fmt="e4m3", block=256))[0]
    unfused = geometry.inverse(grp.run(lambda t: giftcomm.allreduce(geometry.forward(x), comm=t, fmt="e4m3",
                                                                    block=256))[0])
    res["diff"] = float(cp.linalg.norm(fused - unfused) / cp.linalg.norm(unfused))
    res["gift"] = wall(lambda: grp.run(lambda t: giftcomm.gift_allreduce(x, geometry, comm=t, fmt="e4m3", block=256)))
    res["plain"] = wall(lambda: grp.run(lambda t: giftcomm.allreduce(x, comm=t, fmt="e4m3", block=256)))
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import giftcomm.cuda

        ok = giftcomm.cuda.available()
    except Exception:  # noqa: BLE001 - any import failure means no usable GPU
        ok = False
    if not ok:
        print("giftcomm.perf device: needs a CUDA GPU (CuPy and a visible device); none found", file=sys.stderr)
        return NO_GPU_EXIT
    import cupy as cp

    timed = event_timer(cp, args.warmup, args.reps)
    wall = event_timer(cp, args.warmup, args.reps, wall=True, calls=1)
    n = 1 << args.log2n
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    out: list[str] = [f"# giftcomm device benchmark: {name}, {n:,} values per codec call\n"]
    raw: dict[str, Any] = {"device": name, "n": n}

    def save(partial: str = "") -> None:
        """Rewrite the output files with everything so far (a run cut short by perf/device_check.sh's
        time limit keeps what it measured); ``partial``: a section's table so far."""
        if args.out:
            Path(args.out).write_text("\n".join(out + ([partial] if partial else [])) + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1))

    def emit(text: str = "") -> None:
        out.append(text)
        print(text, flush=True)
        save()

    emit(out.pop())
    src = cp.random.standard_normal(n, dtype=cp.float32)
    dst = cp.empty_like(src)
    copy_ms = timed(lambda: cp.copyto(dst, src))
    copy_gbs, line = format_copy(copy_ms, 4 * n)
    raw["copy_ms"] = copy_ms
    emit(line + "\n")
    failures = 0
    if "codec" in args.sections:
        emit("## Codec kernels vs the copy roofline\n")

        def codec_so_far(ct: dict) -> None:
            raw["codec"] = {f"{f}/{b}/{o}": ms for (f, b, o), ms in ct.items()}
            save(format_codec_table(ct, n, copy_gbs) + "\n\n(cut short: the cases measured so far)")

        ct = measure_codec(cp, timed, n, codec_cases(args.formats, args.blocks), codec_so_far)
        emit(format_codec_table(ct, n, copy_gbs) + "\n")
    if "torch" in args.sections:
        emit("## Per-256-block E4M3 cast in PyTorch, side by side\n")
        try:
            pt = measure_torch_peer(cp, timed, n, not args.no_compile)
            raw["torch"] = pt
            emit(format_peer_table(pt, n, copy_gbs) + "\n")
        except Exception as e:  # noqa: BLE001 - report and go on with the other sections
            failures += 1
            emit(f"torch peer failed: {type(e).__name__}: {e}\n")
    if "transform" in args.sections or "gift" in args.sections:
        geometry = llama_layer_geometry(args.rank)
        if "transform" in args.sections:
            emit("## Geometry transform, unfused route (Geometry.forward / inverse)\n")
            tr = measure_transform(cp, timed, geometry)
            raw["transform"] = tr
            emit(format_transform(tr["forward"], tr["inverse"], geometry.size, args.rank, copy_gbs) + "\n")
        if "gift" in args.sections:
            emit(f"## GIFT fused into the codec: the targets (one layer, low-rank KFAC k={args.rank}, e4m3 block 256)\n")
            try:
                g = measure_gift(cp, timed, wall, geometry)
                raw["gift"] = g
                emit(format_gift(g, geometry.size, copy_gbs) + "\n")
            except Exception as e:  # noqa: BLE001
                failures += 1
                emit(f"gift_allreduce section failed: {type(e).__name__}: {e}\n")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
