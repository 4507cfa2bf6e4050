"""The training comparison (studies.train_compare) in its tiny form: every configuration
trains (its loss goes down) with AdamW and with Muon, fp32 and bf16 end close to each other, the
report's numbers are the runs' numbers, and the step-time side prices the wires from the netbed
results in perf/results."""
from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from studies import train
from studies.train_compare import CONFIGS, ci95, mode_name, netbed_seconds_per_value, resolved

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
    # the paper's method transformed the weights its saturation profile selected, and only those:
    # the top quarter of the Linear weights (QUICK: 1 block, 7 Linear weights + the tied head)
    (final,) = [json.load(open(out / f"P2-s0-{mode_name(rows['e5m2t-paper'], 'adamw')}.json"))]
    m = re.match(r"paper selected (\[.*?\]) by E5M2 saturation: ", final["geometry"])
    assert m, final["geometry"]
    selected = ast.literal_eval(m.group(1))
    moved = [seg.split()[0] for seg in final["geometry"].split("; ") if " cholesky " in seg]
    assert 1 <= len(selected) <= 2 and sorted(moved) == sorted(selected), final["geometry"]
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


def test_one_ulp_perturbation_moves_every_weight_one_ulp():
    cfg = train.Config(**vars(train.QUICK))
    a, b, c = train.make_model(cfg, 5), train.make_model(cfg, 5), train.make_model(cfg, 5)
    train.perturb_one_ulp(b, 5)
    train.perturb_one_ulp(c, 5)
    ups = downs = 0
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        x, y = pa.detach().numpy(), pb.detach().numpy()
        assert (y == pc.detach().numpy()).all(), f"{n}: not the same perturbation for the same seed"
        up, down = y == np.nextafter(x, np.float32(np.inf)), y == np.nextafter(x, np.float32(-np.inf))
        assert (up | down).all() and not (up & down).any(), n
        ups, downs = ups + int(up.sum()), downs + int(down.sum())
    assert 0.45 < ups / (ups + downs) < 0.55  # seeded random directions


def test_ci95_covers_the_mean_and_resolved_needs_the_noise_floor():
    rng = np.random.default_rng()
    mu = float(rng.normal())
    covered = sum(lo <= mu <= hi for lo, hi in (ci95(rng.normal(mu, 0.01, 8)) for _ in range(2000)))
    assert 0.93 < covered / 2000 < 0.97  # a paired t interval's nominal 95% coverage
    d = rng.normal(0.0, 1.0, 8)
    lo, hi = ci95(d)
    assert lo < d.mean() < hi and hi - lo == pytest.approx(2 * 2.3646 * d.std(ddof=1) / np.sqrt(8), rel=1e-4)
    assert all(math.isnan(v) for v in ci95([1.0]))
    assert resolved([0.01, 0.02], 0.015, 0.005) and resolved([-0.02, -0.01], -0.015, 0.005)
    assert not resolved([-0.01, 0.02], 0.005, 0.001)          # the interval holds 0
    assert not resolved([0.01, 0.02], 0.015, 0.02)            # inside the noise floor
    assert not resolved([0.01, 0.02], 0.015, float("nan"))    # no floor measured: nothing resolved


def test_powered_comparison_fields_and_verify(tmp_path):
    """The report carries a 95% interval for every gap and decision, the noise floor from the
    one-ulp controls and the validation size; --verify re-runs a committed run bit for bit and
    fails on one that does not reproduce."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "studies", "train-compare", "--quick", "--world", "2", "--seeds", "0,1",
           "--optimizers", "muon", "--configs", "fp32,fp32-ulp,e4m3,e5m2t", "--out", str(out), "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    c = json.load(open(out / "compare.json"))
    assert c["config"]["val_bytes"] == train.QUICK.val_batches * train.QUICK.seq_len
    runs = train.load_runs(str(out))
    ctl = c["noise"]["muon"]["controls"]
    assert [x["row"] for x in ctl] == ["fp32-ulp"] and ctl[0]["n"] == 2
    diffs = [runs[(2, "fp32-ulp-muon")][s][-1]["val_loss"] - runs[(2, "fp32-muon")][s][-1]["val_loss"] for s in (0, 1)]
    assert ctl[0]["diffs"] == pytest.approx(diffs) and c["noise"]["muon"]["floor"] == pytest.approx(
        math.sqrt(np.mean(np.square(diffs))))
    for e in c["rows"] + c["decisions"]:
        assert len(e["ci95"]) == 2 and e["noise_floor"] == c["noise"]["muon"]["floor"]
    (dec,) = [d for d in c["decisions"] if d["row"] == "e4m3" and d["base"] == "e5m2t"]
    assert dec["ci95"][0] < dec["diff"] < dec["ci95"][1]
    verify = [sys.executable, "-m", "studies", "train-compare", "--verify", str(out), "--configs", "e4m3",
              "--optimizers", "muon", "--seeds", "1"]
    proc = subprocess.run(verify, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0 and "1 of 1 runs reproduced bit for bit" in proc.stdout, proc.stdout + proc.stderr
    run = out / "P2-s1-e4m3-n-muon.json"
    rec = json.load(open(run))
    rec["val_loss"] = float(np.nextafter(rec["val_loss"], np.inf))  # one ulp off: not bit for bit
    run.write_text(json.dumps(rec))
    proc = subprocess.run(verify, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 1 and "DIFFERS" in proc.stdout, proc.stdout + proc.stderr
