"""studies.time_to_quality on runs written in studies.train's format: each run's clock is the sum
of its step times, it reaches the target at its first validation at or below it, and the bytes per
step follow the wire format's message sizes."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from giftcomm.formats import message_nbytes
from studies import time_to_quality as ttq
from studies import train

ROOT = Path(__file__).resolve().parent.parent


def _write(folder: Path, mode: str, seed: int, t_step: np.ndarray, val: np.ndarray, every: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, t in enumerate(t_step):
        v = float(val[i]) if i % every == 0 or i == len(t_step) - 1 else float("nan")
        rows.append(dict.fromkeys(train.COLUMNS, 0.0) | dict(mode=mode, world=4, seed=seed, step=i, t_step=float(t),
                                                              val_loss=v, algorithm="ring"))
    train.write_run(str(folder), rows, dict(mode=mode, world=4, seed=seed))


def test_seconds_and_steps_to_the_reference_loss(tmp_path):
    rng = np.random.default_rng()
    steps, every = 40, 5
    loss = np.sort(rng.uniform(2.0, 4.0, steps))[::-1]  # falling validation loss, same for every mode
    slow, fast = rng.uniform(0.5, 1.0, steps), rng.uniform(0.1, 0.4, steps)
    _write(tmp_path, "fp32", 0, slow, loss, every)
    _write(tmp_path, "e4m3-n", 0, fast, loss - 0.01, every)  # a little better at every validation
    result = ttq.analyse({"1gbit": str(tmp_path)}, n_values=100_000)
    rows = {r["mode"]: r for r in result["rates"]["1gbit"]["rows"]}
    target = loss[-1]
    ref, e4 = rows["fp32"]["reference"], rows["e4m3-n"]["reference"]
    assert ref["loss"] == e4["loss"] == pytest.approx(target) and "stated" not in rows["fp32"]
    assert ref["steps"] == steps and ref["seconds"] == pytest.approx(slow.sum())
    # e4m3 reaches the target at its first validation with loss - 0.01 <= target
    first = next(i for i in range(steps) if (i % every == 0 or i == steps - 1) and loss[i] - 0.01 <= target)
    assert e4["steps"] == first + 1 and e4["seconds"] == pytest.approx(fast[: first + 1].sum())
    assert e4["speedup"] == pytest.approx(slow.sum() / fast[: first + 1].sum())
    assert rows["e4m3-n"]["bytes_per_step"] == 2 * 3 * message_nbytes(25_000, "e4m3")
    assert rows["fp32"]["bytes_per_step"] == 2 * 3 * 25_000 * 4
    # a stated target nobody reaches, beside the reference
    never = ttq.analyse({"1gbit": str(tmp_path)}, n_values=100_000, target=float(loss.min()) - 1.0)
    for r in never["rates"]["1gbit"]["rows"]:
        assert r["stated"]["seconds"] is None and r["stated"]["steps"] is None and r["reference"]["steps"] is not None


def test_command_writes_json_and_plot(tmp_path):
    rng = np.random.default_rng()
    for rate in ("100mbit", "1gbit"):
        for mode in ("fp32", "nvfp4-n"):
            _write(tmp_path / rate, mode, 1, rng.uniform(0.1, 1.0, 12), np.linspace(4, 3, 12), 4)
    out = tmp_path / "ttq.json"
    proc = subprocess.run([sys.executable, "-m", "studies", "time-to-quality", f"100mbit={tmp_path / '100mbit'}",
                           f"1gbit={tmp_path / '1gbit'}", "--json", str(out), "--png", str(tmp_path / "ttq.png")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result["rates"]) == {"100mbit", "1gbit"} and "| 1gbit | nvfp4-n | 1 |" in proc.stdout
    assert set(result["targets"]) == {"reference"}
    for r in result["rates"]["1gbit"]["rows"]:
        assert all(math.isfinite(x) for c in r["curve"] for x in c)
    assert (tmp_path / "ttq.png").stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "studies", "time-to-quality", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "RATE=DIR" in bad.stderr
