"""The end-to-end training script's --quick mode runs under mpiexec -n 2 and learns."""
from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

from studies.train import COLUMNS


def test_train_quick_loss_goes_down(tmp_path):
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "studies.train", "--quick", "--steps", "30",
           "--comm", "fp8-euclid,gift", "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for mode in ("fp8-euclid", "gift"):
        with open(tmp_path / f"train-{mode}.csv") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == COLUMNS and len(rows) == 30
        train = [float(r["train_loss"]) for r in rows]
        val = [float(r["val_loss"]) for r in rows if r["val_loss"] != "nan"]
        assert all(math.isfinite(x) for x in train)
        assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.5, f"{mode}: training loss did not go down: {train}"
        assert len(val) >= 3 and val[-1] < val[0] - 0.5, f"{mode}: validation loss did not go down: {val}"
        errs = [float(r["grad_rel_err"]) for r in rows if r["grad_rel_err"] != "nan"]
        assert errs and all(0 < e < 0.2 for e in errs)  # FP8 error is present but bounded
        assert all(float(r["t_step"]) > 0 and float(r["t_comm"]) > 0 for r in rows)
    gift = list(csv.DictReader(open(tmp_path / "train-gift.csv")))
    assert any(float(r["t_transform"]) > 0 for r in gift), "gift mode never applied a geometry"
    assert (tmp_path / "train-curves.png").stat().st_size > 10_000
    assert "| gift |" in (tmp_path / "train-summary.md").read_text()
