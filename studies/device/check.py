"""The one-shot GPU check behind perf/device_check.sh: writes perf/results/device-<date>.md.

Sections (each in its own try block; a failure is written down and the next section runs):
1. device + NVRTC compile of the kernels (time);
2. bit-exactness: every format, edge tables x block sizes, then 10^8 random values (e4m3 and
   e5m2, block 256, in 10^7 pieces) against giftcomm.reference.codec (encode, decode,
   decode_add_encode + sum_out, decode_accumulate);
3. throughput: the device-to-device copy bandwidth (bytes read + written), then encode, decode,
   decode_add_encode, decode_accumulate of 2^28 values, block 256, timed with CUDA events
   (median of 20 after 5 warm-ups) and reported as a fraction of the copy roofline, counting
   5 bytes per value for encode/decode (9 for the fused hop, 9 for decode-accumulate);
4. the GPU loopback ring at P = 4 and 8 against giftcomm.reference.simulate_allreduce;
5. the device path of the public collectives on CuPy at P = 4 and 8 over the GPU loopback
   (studies.device.collective_check: reduce_scatter ring/direct, allgather of unequal shards,
   allgather(reduce_scatter) == allreduce, direct allreduce, gift_allreduce with a low-rank KFAC
   geometry) against the reference simulations, bit for bit;
6. transform cost for Llama-300M / 600M-like layer shapes (hidden 1024 / 1536, MLP 2.7x)
   against the wire time FP8 saves over bf16 at 25, 100 and 400 Gbit/s per GPU.

Usage: python -m studies device-check [--out perf/results] [--quick] (from the checkout's root)
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from giftcomm.reference import codec as ref
from giftcomm.reference import simulate_allreduce
from studies.device.edge_cases import BLOCKS, LENGTHS, edge_vectors, floats_equal, messages_equal, random_vector


class Report:
    def __init__(self, path: Path) -> None:
        self.path, self.lines, self.failures = path, [], 0

    def add(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)
        self.path.write_text("\n".join(self.lines) + "\n")

    def section(self, title: str, fn) -> None:
        self.add(f"\n## {title}\n")
        t0 = time.time()
        try:
            fn(self)
            self.add(f"\n_section time {time.time() - t0:.1f} s_")
        except Exception:
            self.failures += 1
            self.add("**FAILED**\n\n```\n" + traceback.format_exc()[-4000:] + "```")


def _events_ms(cp, fn, warmup: int = 5, reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` by CUDA events (giftcomm.perf.device_bench's timer)."""
    from giftcomm.perf.device_bench import event_timer

    return event_timer(cp, warmup, reps)(fn)


def sec_device(rep: Report) -> None:
    import cupy as cp

    from giftcomm.cuda import _loader

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    rep.add(f"- device: {props['name'].decode()}, cc {props['major']}.{props['minor']}, "
            f"{props['multiProcessorCount']} SMs, {props['totalGlobalMem'] / 2**30:.0f} GiB")
    rep.add(f"- CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
            f"driver {cp.cuda.runtime.driverGetVersion()}, NVRTC {cp.cuda.nvrtc.getVersion()}")
    t0 = time.time()
    _loader.get_module("codec")
    rep.add(f"- NVRTC compile + load of gc_codec.cu: {time.time() - t0:.2f} s (cached afterwards)")


def sec_exact(rep: Report, quick: bool) -> None:
    import cupy as cp

    from giftcomm import codec as gc

    rng = np.random.default_rng(20261129)

    def check(x, fmt, block):
        n = x.size
        with np.errstate(all="ignore"):
            want = ref.encode(x, fmt, block)
            ok, why = messages_equal(cp.asnumpy(gc.encode(cp.asarray(x), fmt, block)), want, n, fmt, block)
            if not ok:
                return f"encode: {why}"
            d = cp.asarray(want)
            dec = ref.decode(want, n, fmt, block)
            if not floats_equal(cp.asnumpy(gc.decode(d, n, fmt, block)), dec).all():
                return "decode"
            local = random_vector(rng, n)
            s = cp.empty(n, cp.float32)
            out = gc.decode_add_encode(d, cp.asarray(local), fmt, block, sum_out=s)
            ok, why = messages_equal(cp.asnumpy(out), ref.encode(dec + local, fmt, block), n, fmt, block)
            if not ok or not floats_equal(cp.asnumpy(s), dec + local).all():
                return f"decode_add_encode: {why or 'sum_out'}"
            acc = cp.asarray(local)
            gc.decode_accumulate(d, acc, fmt, block)
            if not floats_equal(cp.asnumpy(acc), local + dec).all():
                return "decode_accumulate"
        return ""

    rep.add("| fmt | edge cases (tables x blocks) | random lengths x blocks | result |")
    rep.add("| --- | --- | --- | --- |")
    for fmt in ("e4m3", "e5m2", "bf16", "fp16", "fp32"):
        bad, ne, nr = [], 0, 0
        for name, vec in edge_vectors(fmt).items():
            for block in (1, 3, 4, 256, 300, 5000):
                ne += 1
                why = check(vec, fmt, block)
                if why:
                    bad.append(f"{name}/b{block}: {why}")
        for n in LENGTHS:
            for block in BLOCKS:
                nr += 1
                why = check(random_vector(rng, n, 30), fmt, block)
                if why:
                    bad.append(f"n{n}/b{block}: {why}")
        rep.add(f"| {fmt} | {ne} | {nr} | {'OK' if not bad else 'FAIL ' + '; '.join(bad[:3])} |")
    total = 10**7 if quick else 10**8
    for fmt in ("e4m3", "e5m2"):
        done, bad = 0, []
        piece = 10**7
        while done < total:
            x = random_vector(rng, piece, 25)
            x[rng.integers(0, piece, 5)] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
            why = check(x, fmt, 256)
            if why:
                bad.append(why)
            done += piece
        rep.add(f"- {fmt}, {done:.0e} random values, block 256, all four ops: {'OK' if not bad else 'FAIL ' + bad[0]}")
    if any("FAIL" in line for line in rep.lines):
        raise AssertionError("bit-exactness failures above")


def sec_throughput(rep: Report, quick: bool) -> None:
    import cupy as cp

    from giftcomm import codec as gc

    n = (1 << 26) if quick else (1 << 28)
    src = cp.random.standard_normal(n, dtype=cp.float32)
    dst = cp.empty_like(src)
    copy_ms = _events_ms(cp, lambda: cp.copyto(dst, src))
    copy_bw = 2 * src.nbytes / copy_ms / 1e6  # GB/s, read + write
    rep.add(f"- device-to-device copy of {src.nbytes / 2**30:.1f} GiB: {copy_ms:.3f} ms, **{copy_bw:.0f} GB/s** (read + write)\n")
    rep.add("| op | fmt | block | ms | values/s | bytes/value counted | GB/s | % of copy roofline |")
    rep.add("| --- | --- | --- | --- | --- | --- | --- | --- |")
    del dst
    for fmt in ("e4m3", "e5m2"):
        for block in (32, 256, 1024, 8192):
            msg = gc.encode(src, fmt, block)
            local = cp.random.standard_normal(n, dtype=cp.float32)
            out = cp.empty_like(msg)
            dec = cp.empty(n, cp.float32)
            ops = {
                "encode": (lambda: gc.encode(src, fmt, block, out=out), 5),
                "decode": (lambda: gc.decode(msg, n, fmt, block, out=dec), 5),
                "decode_add_encode": (lambda: gc.decode_add_encode(msg, local, fmt, block, out=out), 6),
                "decode_accumulate": (lambda: gc.decode_accumulate(msg, dec, fmt, block), 9),
            }
            for name, (fn, bpv) in ops.items():
                ms = _events_ms(cp, fn)
                gbs = bpv * n / ms / 1e6
                rep.add(f"| {name} | {fmt} | {block} | {ms:.3f} | {n / ms / 1e6:.2f} G | {bpv} | {gbs:.0f} | "
                        f"{100 * gbs / copy_bw:.0f}% |")
            del msg, local, out, dec
    rep.add("\nTarget: encode and decode at >= 70% of the copy roofline (5 bytes per value).")


def sec_ring(rep: Report, quick: bool) -> None:
    import cupy as cp

    import giftcomm
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    rng = np.random.default_rng(7)
    for p in (4, 8):
        for fmt, n, block in (("e4m3", 1_000_003, 256), ("e5m2", 65_537, 32), ("bf16", 10_001, 256), ("e4m3", 3, 1)):
            xs = [random_vector(rng, n, 8) for _ in range(p)]
            dev = [cp.asarray(x) for x in xs]
            t0 = time.time()
            got = DeviceLoopbackGroup(p).run(lambda t: cp.asnumpy(giftcomm.allreduce(
                dev[t.rank], comm=t, op="sum", fmt=fmt, block=block, algorithm="ring")))
            dt = time.time() - t0
            want = simulate_allreduce(xs, fmt, block, "sum", algorithm="ring")
            ok = all(floats_equal(g, w).all() for g, w in zip(got, want))
            same = all(np.array_equal(g.view(np.uint32), got[0].view(np.uint32)) for g in got)
            rep.add(f"- P={p} {fmt} n={n} block={block}: {'OK' if ok and same else 'FAIL'} "
                    f"(equal to simulate_allreduce: {ok}; identical on all ranks: {same}; {dt:.2f} s)")
            if not (ok and same):
                raise AssertionError("ring mismatch")


def sec_collectives(rep: Report, quick: bool) -> None:
    import cupy as cp

    from studies.device.collective_check import collective_checks

    results = collective_checks(cp, cp.asnumpy, quick=quick)
    for label, ok, secs in results:
        rep.add(f"- {label}: {'OK' if ok else 'FAIL'}" + (f" ({secs:.2f} s)" if secs else ""))
    failed = [label for label, ok, _ in results if not ok]
    if failed:
        raise AssertionError(f"{len(failed)} device collective check(s) failed: {failed[:3]}")


def sec_transform(rep: Report, quick: bool) -> None:
    import cupy as cp

    from giftcomm.geometry.dense_plan import SegmentPair, TransformPlan

    rng = np.random.default_rng(3)
    rep.add("| model | layers | params/layer (M) | transform fwd+inv ms | bytes saved (MB) | "
            "FP8 saving ms @25 Gb/s | @100 | @400 |")
    rep.add("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, hidden, layers in (("Llama-300M-like", 1024, 24), ("Llama-600M-like", 1536, 24)):
        mlp = int(round(hidden * 2.7 / 64) * 64)
        shapes = [(hidden, hidden)] * 4 + [(mlp, hidden), (mlp, hidden), (hidden, mlp)]
        pairs, start = [], 0
        for _ in range(layers):
            for m, n in shapes:
                left = np.eye(m, dtype=np.float32)
                right = np.eye(n, dtype=np.float32)
                pairs.append(SegmentPair(start, m, n, left, right, left, right))
                start += m * n
        plan = TransformPlan(start, pairs, xp=cp)
        x = cp.asarray(rng.standard_normal(start).astype(np.float32))
        ms = _events_ms(cp, lambda: plan.inverse(plan.forward(x)), warmup=2, reps=5)
        saved = start * (2 - (1 + 4 / 256))  # bytes per value on the wire: bf16 2, e4m3 1.0156
        ring_factor = 2.0  # a ring allreduce moves ~2x the buffer per GPU (2(P-1)/P)
        cols = [f"{ring_factor * saved * 8 / (g * 1e9) * 1e3:.1f}" for g in (25, 100, 400)]
        rep.add(f"| {name} | {layers} | {start / layers / 1e6:.1f} | {ms:.2f} | {saved / 1e6:.0f} | " + " | ".join(cols) + " |")
        del plan, x
    rep.add("\nTransform: dense fp32 T_L @ X @ T_R and its inverse for every matrix (the dense worst case; "
            "identity factors, so the numbers are GEMM time). Saving: wire time of bf16 minus FP8 for one "
            "ring allreduce of the whole gradient. The transform pays off where its time is below the saving.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies device-check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"device-{datetime.date.today().isoformat()}.md"
    rep = Report(path)
    rep.add(f"# giftcomm device check, {datetime.datetime.now().isoformat(timespec='seconds')}\n")
    rep.add(f"host {platform.node()}, Python {sys.version.split()[0]}, NumPy {np.__version__}"
            + (" (quick run)" if args.quick else ""))
    rep.section("Device and kernel compile", sec_device)
    rep.section("Kernels vs giftcomm.reference.codec, bit for bit", lambda r: sec_exact(r, args.quick))
    rep.section("Kernel throughput vs the device-to-device copy roofline", lambda r: sec_throughput(r, args.quick))
    rep.section("GPU loopback ring vs giftcomm.reference.simulate_allreduce", lambda r: sec_ring(r, args.quick))
    rep.section("Device collectives (public API path) vs the reference simulations",
                lambda r: sec_collectives(r, args.quick))
    rep.section("Transform cost vs the time FP8 saves", lambda r: sec_transform(r, args.quick))
    rep.add(f"\n**{rep.failures} section(s) failed.** Report: {path}")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
