"""GPU check of the DDP hook's device route: DDP at world size 1 on NCCL, a ~50M-parameter
bfloat16 MLP, CUDA buckets.

    python examples/ddp_device_check.py [--steps 20] [--json out.json]   # one GPU, < 8 minutes
    python examples/ddp_device_check.py --dry-run                        # the plan, no GPU needed

Measures, for DDP's default allreduce, PyTorch's ``bf16_compress_hook`` and giftcomm's
``gift_hook`` (e4m3): milliseconds per training step (CUDA events, after warm-up) and the hook's
own cost (step time minus the default allreduce's step time), then profiles a few steps of the
giftcomm hook with torch.profiler and counts device-to-host copies inside the hook's ranges.
Passes (exit code 0) when the hook makes no device-to-host copy and its per-step cost is within
``--ratio`` (1.5) of ``bf16_compress_hook``'s. Prints a short table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch


def build_model(params: float = 50e6, width: int = 2048, dtype: Any = torch.bfloat16, device: Any = "cpu") -> torch.nn.Module:
    """An MLP of square Linear layers of ``width`` with about ``params`` parameters."""
    depth = max(1, round(params / (width * width + width)))
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1]).to(device=device, dtype=dtype)


def format_table(rows: list[dict]) -> str:
    """rows: {"hook", "ms_per_step", "hook_ms", "dtoh_in_hook"} -> an aligned text table."""
    head = f"{'hook':<22}{'ms/step':>10}{'hook ms':>10}{'DtoH in hook':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        dtoh = "-" if r.get("dtoh_in_hook") is None else str(r["dtoh_in_hook"])
        hook_ms = "-" if r.get("hook_ms") is None else f"{r['hook_ms']:.2f}"
        lines.append(f"{r['hook']:<22}{r['ms_per_step']:>10.2f}{hook_ms:>10}{dtoh:>14}")
    return "\n".join(lines)


def verdict(rows: list[dict], ratio: float) -> tuple[bool, str]:
    """(passed, text): giftcomm's hook makes no DtoH copy and costs <= ratio x bf16_compress_hook's."""
    by = {r["hook"]: r for r in rows}
    gift, bf16 = by["gift_hook e4m3"], by["bf16_compress_hook"]
    floor = 0.05  # ms: below this both hooks are free and the ratio means nothing
    cost_ok = gift["hook_ms"] <= ratio * max(bf16["hook_ms"], floor)
    copies_ok = gift["dtoh_in_hook"] == 0
    text = (f"gift_hook cost {gift['hook_ms']:.2f} ms/step vs bf16_compress_hook {bf16['hook_ms']:.2f} ms/step "
            f"(limit {ratio}x): {'ok' if cost_ok else 'FAIL'}; device-to-host copies in the hook: "
            f"{gift['dtoh_in_hook']} ({'ok' if copies_ok else 'FAIL'})")
    return cost_ok and copies_ok, text


def _train(ddp, opt, steps: int, warmup: int, batch: int, width: int, dtype) -> float:
    """ms per step (CUDA events) after ``warmup`` steps."""
    x = torch.randn(batch, width, device="cuda", dtype=dtype)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(steps + warmup):
        if i == warmup:
            torch.cuda.synchronize()
            start.record()
        opt.zero_grad(set_to_none=False)
        ddp(x).float().pow(2).mean().backward()
        opt.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def run(args) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from giftcomm import GiftSchedule
    from giftcomm.adapters.torch import GiftState, gift_hook

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    dtype = getattr(torch, args.dtype)
    rows = []
    states = []

    def make(kind: str):
        torch.manual_seed(0)
        model = build_model(args.params, args.width, dtype, "cuda")
        ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
        if kind == "bf16_compress_hook":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif kind.startswith("gift_hook"):
            st = GiftState(fmt="e4m3", schedule=GiftSchedule(warmup=0), param_names=model)
            states.append(st)
            ddp.register_comm_hook(st, _ranged(gift_hook))
        return ddp, torch.optim.SGD(model.parameters(), lr=1e-4)

    for kind in ("default allreduce", "bf16_compress_hook", "gift_hook e4m3"):
        ddp, opt = make(kind)
        ms = _train(ddp, opt, args.steps, args.warmup, args.batch, args.width, dtype)
        rows.append({"hook": kind, "ms_per_step": ms})
        del ddp, opt
        torch.cuda.empty_cache()
    base = rows[0]["ms_per_step"]
    for r in rows:
        r["hook_ms"] = r["ms_per_step"] - base
    # device-to-host copies inside the hook, from the profiler
    ddp, opt = make("gift_hook e4m3")
    _train(ddp, opt, 2, 2, args.batch, args.width, dtype)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _train(ddp, opt, 3, 0, args.batch, args.width, dtype)
    rows[2]["dtoh_in_hook"] = count_dtoh_in_ranges(prof.events(), "giftcomm_hook")
    rows[1]["dtoh_in_hook"] = None
    for st in states:
        st.shutdown()
    dist.destroy_process_group()
    return rows


def _ranged(hook):
    """The hook inside a profiler range named giftcomm_hook."""
    def ranged(state, bucket):  # no annotations: DDP compares them as objects
        with torch.profiler.record_function("giftcomm_hook"):
            return hook(state, bucket)
    return ranged


def count_dtoh_in_ranges(events, name: str) -> int:
    """Device-to-host memcpys (runtime calls or GPU copies) launched inside the CPU ranges called
    ``name``: a memcpy whose CPU launch interval lies in a range, or whose linked CPU op does."""
    ranges = [(e.time_range.start, e.time_range.end, e.thread) for e in events if e.name == name]
    count = 0
    for e in events:
        label = e.name.lower()
        is_dtoh = ("dtoh" in label or "device -> pageable" in label or "device -> pinned" in label
                   or (e.name in ("cudaMemcpy", "cudaMemcpyAsync") and "dtoh" in str(getattr(e, "input_shapes", "")).lower()))
        if not is_dtoh and e.name not in ("aten::_local_scalar_dense", "aten::item"):
            continue
        t = e.time_range.start
        if any(a <= t <= b and e.thread == th for a, b, th in ranges):
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ratio", type=float, default=1.5)
    p.add_argument("--json", help="write the rows and the verdict here")
    p.add_argument("--dry-run", action="store_true", help="print the plan (model size) and exit; no GPU needed")
    args = p.parse_args(argv)
    model = build_model(args.params, args.width, getattr(torch, args.dtype), "meta")
    n = sum(q.numel() for q in model.parameters())
    print(f"plan: DDP world size 1 on NCCL, {n / 1e6:.1f}M-parameter {args.dtype} MLP (width {args.width}), "
          f"batch {args.batch}, {args.steps} timed steps; hooks: default, bf16_compress_hook, gift_hook e4m3", flush=True)
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = run(args)
    ok, text = verdict(rows, args.ratio)
    print(format_table(rows))
    print(text)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "passed": ok, "verdict": text, "params": n}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
