"""The device checks perf/device_check.sh runs after tests/test_gpu.py: what only a GPU can show
beyond the kernels themselves. Writes a Markdown report and a JSON summary.

Sections (each in its own try block: a failure is written down and the next section runs):
- ``collectives``: ``giftcomm.allreduce`` on CuPy arrays over ``DeviceLoopbackGroup(P)`` for every
  format, rounding (nearest; stochastic for the scaled formats) and algorithm, float32 and float64
  inputs, normal data and a subnormal probe (values 2^-150..2^-100, where CuPy's -ftz=true
  arithmetic would flush), against ``giftcomm.reference.simulate_allreduce`` bit for bit;
- ``ddp``: the DDP hook's device route (``gift_hook`` over a grouped device loopback at P = 2,
  CUDA bucket tensors) with host copies refused (``Tensor.cpu/numpy/to/tolist/item`` raise):
  every rank's result bit-identical to the simulation (= the host path) and to each other;
- ``plans``: ``plan_allreduce`` on device arrays, three calls with fresh data, against the simulation;
- ``jax``: JAX GPU arrays (float32, bfloat16) through ``giftcomm.allreduce`` (skipped, and said
  so, when JAX has no GPU backend).

``python -m studies.device.matrix [--out DIR] [--quick] [--sections a,b]`` (real CuPy). The same
functions take any CuPy-like module: tests/test_gpu_emulated.py runs a small part on the CPU
stand-in, so the script is known to work before it reaches a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np

FORMATS = ("e4m3", "e5m2", "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4", "bf16", "fp16", "fp32")
ALGORITHMS = ("ring", "direct", "doubling", "oneshot", "hierarchical", "hierarchical_direct")
SCALED = ("e4m3", "e5m2", "mxfp8", "mxfp8_e5m2", "mxfp4", "nvfp4")


def data(rng: np.random.Generator, p: int, n: int, dtype: Any, kind: str) -> list[np.ndarray]:
    """Per-rank inputs: ``normal`` (magnitudes spread over e^+-4) or ``subnormal`` (2^-150..2^-100)."""
    if kind == "subnormal":
        return [(rng.standard_normal(n) * 2.0 ** rng.uniform(-150, -100, n)).astype(dtype) for _ in range(p)]
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-4, 4, n))).astype(dtype) for _ in range(p)]


def mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    """None when bit-identical (any NaN matches any NaN), else a short description."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    bad = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))) | (np.signbit(got) != np.signbit(want)))
    if bad.size == 0:
        return None
    i = int(bad[0])
    return f"{bad.size} of {got.size} differ, e.g. [{i}] {got.reshape(-1)[i]!r} vs {want.reshape(-1)[i]!r}"


def allreduce_case(cp: Any, rng: np.random.Generator, p: int, algorithm: str, fmt: str, dtype: Any, op: str,
                   rounding: str = "nearest", kind: str = "normal", n: int = 777, block: int | None = None) -> str | None:
    """One allreduce on ``cp`` arrays over the device loopback against the simulation; None or what differs."""
    import giftcomm as gc
    from giftcomm.formats import get_format
    from giftcomm.reference import simulate_allreduce
    from giftcomm.reference.simulate import resolve_algorithm
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    local_size = (2 if p % 2 == 0 else 1) if algorithm.startswith("hierarchical") else None
    seed = 1234 if rounding == "stochastic" else None
    xs = data(rng, p, n, dtype, kind)
    args = [cp.asarray(x) for x in xs]
    got = DeviceLoopbackGroup(p).run(lambda t: gc.allreduce(args[t.rank], comm=t, op=op, fmt=fmt, block=block,
                                                            algorithm=algorithm, local_size=local_size,
                                                            rounding=rounding, seed=seed))
    ran = resolve_algorithm(algorithm, n, p, None, fmt, block or get_format(fmt).default_block())
    want = simulate_allreduce(xs, fmt, block, op, ran, local_size=local_size, rounding=rounding, seed=seed)
    for r in range(p):
        if not isinstance(got[r], cp.ndarray):
            return f"rank {r}: result is {type(got[r]).__name__}, not a device array"
        why = mismatch(cp.asnumpy(got[r]), want[r])
        if why:
            return f"rank {r}: {why}"
    return None


def collectives(cp: Any, rng: np.random.Generator, quick: bool, report: Callable[[str], None],
                formats: tuple[str, ...] = FORMATS, algorithms: tuple[str, ...] = ALGORITHMS) -> dict:
    cases, failures = 0, []
    p_list = (3,) if quick else (3, 4)
    for algorithm in algorithms:
        for fmt in formats:
            for rounding in ("nearest", "stochastic") if fmt in SCALED else ("nearest",):
                for dtype in (np.float32, np.float64):
                    for kind in ("normal", "subnormal"):
                        for p in p_list:
                            op = ("sum", "avg")[cases % 2]
                            why = allreduce_case(cp, rng, p, algorithm, fmt, dtype, op, rounding, kind)
                            cases += 1
                            if why:
                                failures.append(f"{algorithm} {fmt} {rounding} {np.dtype(dtype).name} {kind} P={p} {op}: {why}")
    report(f"{cases - len(failures)} of {cases} allreduce cases bit-identical to simulate_allreduce "
           f"(algorithms {', '.join(algorithms)}; formats {', '.join(formats)}; P {p_list}; normal and subnormal data)")
    for f in failures[:30]:
        report(f"- FAIL {f}")
    return {"cases": cases, "failures": failures}


def ddp(cp: Any, rng: np.random.Generator, quick: bool, report: Callable[[str], None]) -> dict:
    import torch

    from giftcomm.adapters.torch.ddp import GiftState, gift_hook
    from giftcomm.reference import simulate_allreduce
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    class Bucket:
        def __init__(self, buf: Any) -> None:
            self.buf = buf

        def buffer(self) -> Any:
            return self.buf

        def index(self) -> int:
            return 0

        def is_last(self) -> bool:
            return True

        def parameters(self) -> list:
            return []

        def gradients(self) -> list:
            return [self.buf]

    def refuse(name: str) -> Callable:
        def method(self: Any, *a: Any, **k: Any) -> Any:
            if getattr(self, "is_cuda", False):
                raise AssertionError(f"the device route called torch.Tensor.{name} on a CUDA tensor")
            return orig[name](self, *a, **k)
        return method

    P, n, cases, failures = 2, 1 << (16 if quick else 20), 0, []
    names = ("cpu", "numpy", "to", "tolist", "item")
    orig = {k: getattr(torch.Tensor, k) for k in names}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) for _ in range(P)]
        group = DeviceLoopbackGroup(P)
        states = group.run(lambda t: GiftState(transport=t))
        bufs = [x.cuda() for x in xs]
        try:
            for k in names:
                setattr(torch.Tensor, k, refuse(k))
            outs = group.run(lambda t: gift_hook(states[t.rank], Bucket(bufs[t.rank])).wait())
            torch.cuda.synchronize()
        finally:
            for k in names:
                setattr(torch.Tensor, k, orig[k])
        for st in states:
            st.shutdown()
        want = torch.from_numpy(simulate_allreduce([x.float().numpy() for x in xs], "e4m3", 256, "avg")[0]).to(dtype)
        got = [o.cpu() for o in outs]
        cases += 1
        if not all(torch.equal(g, want) for g in got):
            failures.append(f"{dtype}: a rank's bucket differs from the host path's result")
        if not torch.equal(got[0], got[1]):
            failures.append(f"{dtype}: ranks differ")
        if any(o.data_ptr() != b.data_ptr() for o, b in zip(outs, bufs)):
            failures.append(f"{dtype}: not reduced in place")
    report(f"DDP hook device route, P = {P} over the grouped device loopback, {n} values, no host copy: "
           f"{cases - len(failures)} of {cases} dtypes bit-identical to the host path, ranks identical")
    for f in failures:
        report(f"- FAIL {f}")
    return {"cases": cases, "failures": failures}


def plans(cp: Any, rng: np.random.Generator, quick: bool, report: Callable[[str], None]) -> dict:
    import giftcomm as gc
    from giftcomm.reference import simulate_allreduce
    from giftcomm.reference.simulate import resolve_algorithm
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    cases, failures, p, n = 0, [], 3, 5000
    for fmt in ("e4m3", "nvfp4", "fp32"):
        for algorithm in ("ring", "direct", "auto"):
            group = DeviceLoopbackGroup(p)
            template = cp.zeros(n, cp.float32)
            plans_ = group.run(lambda t: gc.plan_allreduce(template, comm=t, fmt=fmt, algorithm=algorithm))
            for _ in range(3):
                xs = data(rng, p, n, np.float32, "normal")
                args = [cp.asarray(x) for x in xs]
                got = group.run(lambda t: plans_[t.rank](args[t.rank]))
                ran = getattr(plans_[0], "algorithm", None)
                ran = getattr(ran, "name", ran) or resolve_algorithm(algorithm, n, p, None, fmt, 256)
                want = simulate_allreduce(xs, fmt, None, "sum", ran)
                cases += 1
                for r in range(p):
                    why = mismatch(cp.asnumpy(got[r]), want[r])
                    if why:
                        failures.append(f"{fmt} {algorithm} ({ran}) rank {r}: {why}")
                        break
    report(f"plan_allreduce on device arrays: {cases - len(failures)} of {cases} calls bit-identical to the simulation")
    for f in failures:
        report(f"- FAIL {f}")
    return {"cases": cases, "failures": failures}


def jax_arrays(cp: Any, rng: np.random.Generator, quick: bool, report: Callable[[str], None]) -> dict:
    try:
        import jax
        import jax.numpy as jnp

        gpus = jax.devices("gpu")
    except Exception as exc:  # no JAX, or JAX without a CUDA backend
        report(f"skipped: JAX has no GPU backend here ({type(exc).__name__}: {exc})")
        return {"skipped": True}
    import giftcomm as gc
    from giftcomm.reference import simulate_allreduce
    from giftcomm.transport.device_loopback import DeviceLoopbackGroup

    cases, failures, p, n = 0, [], 2, 4099
    for dtype in (jnp.float32, jnp.bfloat16):
        xs = data(rng, p, n, np.float32, "normal")
        arrs = [jax.device_put(jnp.asarray(x, dtype), gpus[0]) for x in xs]
        got = DeviceLoopbackGroup(p).run(lambda t: gc.allreduce(arrs[t.rank], comm=t, fmt="e4m3"))
        host = [np.asarray(a).astype(np.float32) for a in arrs]
        want = simulate_allreduce(host, "e4m3", None, "sum")
        cases += 1
        for r in range(p):
            g = np.asarray(got[r]).astype(np.float32)
            w = want[r].astype(np.asarray(arrs[0]).dtype).astype(np.float32)
            why = mismatch(g, w)
            if why:
                failures.append(f"{dtype.__name__ if hasattr(dtype, '__name__') else dtype} rank {r}: {why}")
    report(f"JAX GPU arrays: {cases - len(failures)} of {cases} dtypes bit-identical to the simulation")
    for f in failures:
        report(f"- FAIL {f}")
    return {"cases": cases, "failures": failures}


SECTIONS: dict[str, Callable] = {"collectives": collectives, "ddp": ddp, "plans": plans, "jax": jax_arrays}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.device.matrix", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--quick", action="store_true", help="fewer world sizes and smaller buckets")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    args = ap.parse_args(argv)
    import cupy

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    tag = args.sections.replace(",", "-")
    md, js = out / f"device-matrix-{tag}-{stamp}.md", out / f"device-matrix-{tag}-{stamp}.json"
    lines = [f"# Device matrix {stamp}", ""]
    summary: dict[str, Any] = {}
    rng = np.random.default_rng(20261201)
    failed = 0
    for name in args.sections.split(","):
        lines += [f"## {name}", ""]
        t0 = time.time()
        try:
            summary[name] = SECTIONS[name](cupy, rng, args.quick, lambda s: (print(s, flush=True), lines.append(s)))
            failed += bool(summary[name].get("failures"))
        except Exception:
            failed += 1
            summary[name] = {"error": traceback.format_exc()[-3000:]}
            lines += ["**FAILED**", "", "```", summary[name]["error"], "```"]
            print(summary[name]["error"], flush=True)
        summary[name]["seconds"] = round(time.time() - t0, 1)
        lines += ["", f"_section time {time.time() - t0:.1f} s_", ""]
        md.write_text("\n".join(lines) + "\n")
        js.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
