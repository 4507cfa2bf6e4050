"""The examples run: torchrun DDP (2 processes, gloo), mpiexec GradSync + KFAC, JAX, each in its
quick mode; the GPU device check's CPU-side parts (plan, model size, table, verdict, profiler
filter)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"


def _run(cmd: list[str], timeout: float = 120) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def test_ddp_torchrun_quick():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
                str(EX / "ddp_torchrun.py"), "--quick", "--geometry", "kfac", "--dtype", "bfloat16"])
    assert "world 2 bfloat16 geometry=kfac" in out and "host buckets" in out


def _mpiexec() -> str:
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpiexec")
    return exe


def test_gradsync_kfac_mpi_quick():
    out = _run([_mpiexec(), "-n", "2", sys.executable, str(EX / "gradsync_kfac_mpi.py"), "--quick"])
    assert "2 ranks" in out and "transformed segments" in out


def test_zero_sharded_adam_quick():
    out = _run([_mpiexec(), "-n", "3", sys.executable, str(EX / "zero_sharded_adam.py"), "--quick"])
    assert "3 ranks" in out and "parameters identical on every rank: True" in out


def test_jax_quick():
    out = _run([_mpiexec(), "-n", "2", sys.executable, str(EX / "jax_train.py"), "--quick"])
    assert "parameters identical on every rank: True" in out


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
