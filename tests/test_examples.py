"""The examples run, each in its quick mode and showing what it claims: torchrun DDP (2 processes,
gloo; GIFT transforms segments), Lightning's Trainer (its own launcher and torchrun; the strategy
route and GiftCommCallback), Accelerate (``accelerate launch``, 2 CPU processes), mpiexec GradSync +
KFAC, JAX (TreeSync under mpiexec; the jitted Flax/Optax step with giftcomm's pmean); the GPU device check's CPU-side parts (plan, model
size, table, verdict, profiler filter). The snippets of README.md and docs/*.md: test_docs_snippets.py."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import _launch  # tests/_launch.py

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"


def _run(cmd: list[str], timeout: float = 120, cwd: Path = ROOT) -> str:
    """The command's stdout; it must exit 0 within ``timeout`` seconds and warn nothing of giftcomm's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = _launch.run(cmd, timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "giftcomm GiftState:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def _transformed(out: str) -> int:
    """The "N transformed segments" an example printed (its GIFT geometry did something)."""
    found = re.findall(r"(\d+) transformed segments", out)
    assert found, out
    return int(found[-1])


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_ddp_torchrun_quick():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                str(EX / "ddp_torchrun.py"), "--quick", "--geometry", "kfac", "--dtype", "bfloat16"])
    assert "world 2 bfloat16 geometry=kfac" in out and "host buckets" in out
    assert _transformed(out) > 0, out


def _mpiexec() -> str:
    exe = shutil.which("mpiexec")
    assert exe is not None, "no mpiexec on PATH: the mpich wheel (a dependency) provides it"
    return exe


def test_gradsync_kfac_mpi_quick():
    out = _run([_mpiexec(), "-n", "2", sys.executable, str(EX / "gradsync_kfac_mpi.py"), "--quick"])
    assert "2 ranks" in out and _transformed(out) > 0, out


def test_zero_sharded_adam_quick():
    out = _run([_mpiexec(), "-n", "3", sys.executable, str(EX / "zero_sharded_adam.py"), "--quick"])
    assert "3 ranks" in out and "parameters identical on every rank: True" in out


def test_jax_quick():
    out = _run([_mpiexec(), "-n", "2", sys.executable, str(EX / "jax_train.py"), "--quick"])
    assert "parameters identical on every rank: True" in out and _transformed(out) > 0, out


def test_jax_jit_train_quick():
    """Flax + Optax with giftcomm's pmean inside the jitted shard_map step (traced per-step
    seeds, error feedback) trains to lax.pmean's loss within the example's 10% tolerance."""
    out = _run([sys.executable, str(EX / "jax_jit_train.py"), "--steps", "40", "--devices", "4", "--batch", "128",
                "--rounding", "stochastic", "--feedback"], timeout=600)
    assert "devices 4 (cpu)" in out, out
    first = float(re.search(r"initial loss ([\d.]+)", out).group(1))
    base = float(re.search(r"lax.pmean final loss ([\d.]+)", out).group(1))
    gift = float(re.search(r"giftcomm pmean final loss ([\d.]+)", out).group(1))
    assert base < 0.5 * first and abs(gift - base) <= 0.10 * base, out


# ----------------------------------------------------------------------- Lightning, Accelerate
def _hook_counts(out: str) -> tuple[int, int]:
    """(warm-up, host) buckets from the Lightning / Accelerate examples' line."""
    m = re.search(r"(\d+) warm-up / (\d+) host / \d+ device buckets", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def test_lightning_strategy_route_with_lightnings_launcher():
    """``DDPStrategy(ddp_comm_state=GiftState(...), ddp_comm_hook=gift_hook)`` with the state built
    before any process group; Lightning starts the second process itself (CPU, gloo)."""
    out = _run([sys.executable, str(EX / "lightning_ddp.py"), "--quick", "--route", "strategy"], timeout=240)
    assert "lightning strategy route: world 2, e4m3, 6 iterations" in out, out
    assert out.count("the hook used the strategy's GiftState: True") == 2, out
    assert _hook_counts(out) == (2, 4) and "parameters identical on every rank: True" in out, out


def test_lightning_callback_under_torchrun_nvfp4_bf16_mixed():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                str(EX / "lightning_ddp.py"), "--quick", "--fmt", "nvfp4", "--precision", "bf16-mixed"], timeout=240)
    assert "lightning callback route: world 2, nvfp4, 6 iterations" in out, out
    assert _hook_counts(out) == (2, 4) and "parameters identical on every rank: True" in out, out


def test_accelerate_prepare_then_register_comm_hook():
    """``accelerate launch --multi_gpu --num_processes 2`` is what starts 2 processes on a CPU
    machine (``--cpu --num_processes 2`` starts one)."""
    out = _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                _free_port(), str(EX / "accelerate_ddp.py"), "--quick"], timeout=240)
    assert "accelerate: 2 processes (DistributedType.MULTI_CPU), e4m3, 6 iterations" in out, out
    assert _hook_counts(out)[1] > 0 and "parameters identical on every rank: True" in out, out


def _device_check():
    spec = importlib.util.spec_from_file_location("ddp_device_check", EX / "ddp_device_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_device_check_cpu_parts(capsys):
    import torch

    mod = _device_check()
    assert mod.main(["--dry-run"]) == 0
    assert "50.4M-parameter bfloat16" in capsys.readouterr().out
    model = mod.build_model(50e6, 2048, torch.bfloat16, "meta")
    assert 45e6 < sum(p.numel() for p in model.parameters()) < 55e6
    rows = [{"hook": "default allreduce", "ms_per_step": 3.0, "hook_ms": 0.0},
            {"hook": "bf16_compress_hook", "ms_per_step": 5.0, "hook_ms": 2.0, "dtoh_in_hook": None},
            {"hook": "gift_hook e4m3", "ms_per_step": 6.0, "hook_ms": 3.0, "dtoh_in_hook": 0}]
    table = mod.format_table(rows)
    assert "gift_hook e4m3" in table and "3.00" in table
    assert mod.verdict(rows, 1.5)[0]
    rows[2]["dtoh_in_hook"] = 1
    assert not mod.verdict(rows, 1.5)[0]
    rows[2].update(dtoh_in_hook=0, hook_ms=3.5)
    assert not mod.verdict(rows, 1.5)[0]


def test_device_check_profiler_filter():
    mod = _device_check()

    def ev(name, start, end, thread=1):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread)

    events = [ev("giftcomm_hook", 10, 20), ev("Memcpy DtoH (Device -> Pageable)", 12, 13),
              ev("Memcpy DtoH (Device -> Pageable)", 30, 31), ev("Memcpy HtoD (Pageable -> Device)", 14, 15),
              ev("aten::item", 15, 16), ev("Memcpy DtoH (Device -> Pinned)", 11, 12, thread=2)]
    assert mod.count_dtoh_in_ranges(events, "giftcomm_hook") == 2
