"""The training comparison (studies.train_compare) in its tiny form: every configuration
trains (its loss goes down) with AdamW and with Muon, fp32 and bf16 end close to each other, the
report's numbers are the runs' numbers, and the step-time side prices the wires from the netbed
results in perf/results."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from studies import train
from studies.train_compare import CONFIGS, mode_name, netbed_seconds_per_value

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
KEYS = ("fp32", "bf16", "e5m2t-paper", "e4m3", "e4m3-ef", "nvfp4-gift")


def test_muon_mode_and_optimizer_split():
    m = train.parse_mode("e4m3-n-ef-gift-muon")
    assert (m.fmt, m.ef, m.gift, m.opt) == ("e4m3", True, True, "muon")
    assert m.twin == "e4m3-n-ef-muon" and m.reference == "fp32-muon"
    assert train.parse_mode("nvfp4").reference == "fp32"
    cfg = train.Config(**vars(train.QUICK))
    model = train.make_model(cfg, 0)
    muon, adamw = train.make_optimizers(model, "muon", cfg)
    hidden = {id(p) for g in muon.param_groups for p in g["params"]}
    rest = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert not hidden & rest and hidden | rest == {id(p) for p in model.parameters()}
    # Muon gets the blocks' 2-D weights only; the tied embedding and the norm scales stay on AdamW
    for n, p in model.named_parameters():
        assert (id(p) in hidden) == (p.ndim == 2 and n.startswith("blocks.")), n
    with pytest.raises(ValueError):
        train.make_optimizers(model, "sgd", cfg)
    m = train.parse_mode("e5m2t-n-ef-paper-muon")
    assert (m.fmt, m.preset, m.gift, m.ef, m.opt) == ("e5m2t", "paper", True, True, "muon")
    for bad in ("e5m2t-s", "e5m2t-ef", "e5m2t-gift"):  # the baseline wire: nearest, paper preset, EF with it
        with pytest.raises(ValueError):
            train.parse_mode(bad)


def test_netbed_prices_follow_the_bytes():
    p = {k: v["s_per_value"] for k, v in netbed_seconds_per_value().items()}
    # wire-bound at 1 Gbit/s: fewer bytes per value, less time (4, 2, 1.02, 0.57 bytes)
    assert p["fp32"] > p["bf16"] > p["e4m3"] > p["nvfp4"] > 0
    assert 1.5 < p["fp32"] / p["bf16"] < 2.5 and 2.5 < p["fp32"] / p["e4m3"] < 5


def test_train_compare_quick(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "studies", "train-compare", "--quick", "--world", "2", "--seeds", "0",
           "--configs", ",".join(KEYS), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = train.load_runs(str(out))
    rows = {r.key: r for r in CONFIGS}
    for opt in ("adamw", "muon"):
        finals = {}
        for key in KEYS:
            (seed_rows,) = runs[(2, mode_name(rows[key], opt))].values()
            loss = [r["train_loss"] for r in seed_rows]
            assert all(math.isfinite(x) for x in loss)
            assert loss[-1] < loss[0] - 0.5, f"{opt} {key}: loss did not go down: {loss}"
            finals[key] = seed_rows[-1]["val_loss"]
        # bf16 changes the gradient by ~1e-3 relative: the runs end close (the loss fell by > 0.5)
        assert abs(finals["bf16"] - finals["fp32"]) < 0.05, finals
        assert all(abs(v - finals["fp32"]) < 0.3 for v in finals.values()), finals
    c = json.load(open(out / "compare.json"))
    by = {(e["opt"], e["key"]): e for e in c["rows"]}
    assert set(by) == {(o, k) for o in ("adamw", "muon") for k in KEYS}
    for (opt, _key), e in by.items():
        (r,) = runs[(2, e["mode"])].values()
        (ref,) = runs[(2, mode_name(rows["fp32"], opt))].values()
        assert e["val"] == pytest.approx(r[-1]["val_loss"])
        assert e["gap"] == pytest.approx(r[-1]["val_loss"] - ref[-1]["val_loss"])
    # the GIFT row ran a transform and the others did not; the decision rows pair what they say
    assert by[("muon", "nvfp4-gift")]["t_transform"] > 0 and by[("muon", "e4m3")]["t_transform"] == 0
    assert by[("adamw", "e5m2t-paper")]["t_transform"] > 0
    # the paper's preset transformed the MLP down projections only
    (final,) = [json.load(open(out / f"P2-s0-{mode_name(rows['e5m2t-paper'], 'adamw')}.json"))]
    moved = [seg.split()[0] for seg in final["geometry"].split("; ") if " cholesky " in seg]
    assert moved and all(n.endswith("mlp.down.weight") for n in moved), final["geometry"]
    ef = [d for d in c["decisions"] if d["row"] == "e4m3-ef" and d["opt"] == "adamw"]
    assert len(ef) == 1 and ef[0]["diff"] == pytest.approx(by[("adamw", "e4m3-ef")]["val"] - by[("adamw", "e4m3")]["val"])
    t = {(x["opt"], x["key"]): x for x in c["time"]}
    assert t[("adamw", "e4m3")]["saved_vs_fp32_ms"] > t[("adamw", "bf16")]["saved_vs_fp32_ms"] > 0
    assert "| muon | giftcomm E4M3 block 256 |" in (out / "compare.md").read_text()
    assert (out / "train-curves.png").stat().st_size > 10_000


def test_skip_existing_needs_a_complete_run_of_the_same_length(tmp_path):
    out = str(tmp_path)
    rows = [dict.fromkeys(train.COLUMNS, 0.0) | dict(mode="e4m3-n", world=4, seed=1, step=i, algorithm="ring")
            for i in range(7)]
    assert not train.run_exists(out, 4, 1, "e4m3-n", 7)
    train.write_run(out, rows, dict(mode="e4m3-n", world=4, seed=1))
    assert train.run_exists(out, 4, 1, "e4m3-n", 7)
    # another length, seed, world or mode is another run; a run without its .json is incomplete
    assert not train.run_exists(out, 4, 1, "e4m3-n", 8)
    assert not train.run_exists(out, 4, 2, "e4m3-n", 7) and not train.run_exists(out, 2, 1, "e4m3-n", 7)
    assert not train.run_exists(out, 4, 1, "e4m3-n-ef", 7)
    os.remove(os.path.join(out, "P4-s1-e4m3-n.json"))
    assert not train.run_exists(out, 4, 1, "e4m3-n", 7)


def test_size_presets_grow():
    n = {k: train.make_model(c, 0).num_parameters() for k, c in train.SIZES.items()}
    assert n["grid"] < n["medium"] < n["large"] and 1.5e6 < n["large"] < 2.0e6, n
    assert train.SIZES["large"].dim // train.SIZES["large"].heads == train.SIZES["medium"].dim // train.SIZES["medium"].heads
