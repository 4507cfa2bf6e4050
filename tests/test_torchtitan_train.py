"""torchtitan's own trainer (``torchtitan.train.main``, torchtitan 0.3.0, in the test extra) trains
its Llama-3 debug model (``llama3_debugmodel``: 6 layers, dim 256, vocabulary 2048) for STEPS
steps of FSDP2 at dp_shard = 2 over gloo on the CPU, once through torchtitan's stock config
(``--module llama3``) and once through ``--module giftcomm.recipes.torchtitan``
(GIFTCOMM_FMT=e4m3), one after the other in one torchrun launch of 2 processes.

Asserted: with giftcomm, every rank's model carries the comms the recipe installed (one per FSDP2
module: the embeddings, the 6 blocks, the final norm with the output layer, and the root) and they
ran 9 calls a step and sent e4m3 bytes; the stock run has none; both ranks log the same losses; the
losses agree across the two runs within ``LOSS_TOL`` (step 1's exactly: its loss comes before any
gradient was reduced; later steps see AdamW updates made from e4m3-rounded gradients, which moved
the loss by <= 5e-5 in the runs of 2026-12-06) but not exactly; the loss falls.

torchtitan's wheel ships no assets, so the test writes a word-level tokenizer and a small
JSON-lines text set to ``tmp_path`` (perf/torchtitan_cpu.py's ``write_assets``), and points the
Hugging Face datasets cache there too. The CPU shims live in perf/torchtitan_cpu.py and the
launcher torchrun runs in place of ``-m torchtitan.train`` in tests/_torchtitan_cpu.py, never in
the library.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

STEPS = 2
LOSS_TOL = 2e-3  # |giftcomm loss - stock loss| per step after the first (measured: <= 5e-5)
HERE = Path(__file__).resolve().parent
RUNS = ["stock", "giftcomm"]  # the launch's run order (run0-*, run1-*)


def _cpu_module():
    """perf/torchtitan_cpu.py, loaded from its path (perf/ is not a package)."""
    spec = importlib.util.spec_from_file_location("torchtitan_cpu", HERE.parent / "perf" / "torchtitan_cpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(root: Path) -> dict[str, list[dict]]:
    """Every rank's report (losses, giftcomm comm count and stats) of each run of one launch."""
    cpu = _cpu_module()
    tok, data = cpu.write_assets(root)
    out = root / "report"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIFTCOMM_")}
    env.update(TITAN_TEST_REPORT=str(out), PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_DATASETS_CACHE=str(root / "hf-datasets"), HF_HUB_OFFLINE="1",
               GIFTCOMM_FMT="e4m3")
    common = ["--config", "llama3_debugmodel", "--training.steps", str(STEPS), "--training.seq_len", "256",
              "--training.local_batch_size", "2", *cpu.flags(tok, data, root / "dump")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "_torchtitan_cpu.py"), "--module", "llama3", *common,
           "--next", "--module", "giftcomm.recipes.torchtitan", *common]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return {name: [json.loads((out / f"run{i}-rank{r}.json").read_text()) for r in range(2)]
            for i, name in enumerate(RUNS)}


def test_torchtitan_debug_model_trains_with_giftcomm(tmp_path):
    runs = _train(tmp_path)
    gift, stock = runs["giftcomm"], runs["stock"]
    for rep in stock:
        assert rep["comms"] is None
    for rep in gift:
        assert rep["comms"] == 9  # one GiftReduceScatter per FSDP2 module
        stats = rep["stats"]
        assert stats["calls"] == 9 * STEPS
        assert stats["bytes_sent"].get("e4m3", 0) > 0
    g_loss = [loss for _, loss, _ in gift[0]["losses"]]
    s_loss = [loss for _, loss, _ in stock[0]["losses"]]
    assert [s for s, _, _ in gift[0]["losses"]] == [s for s, _, _ in stock[0]["losses"]] == list(range(1, STEPS + 1))
    assert gift[0]["losses"] == gift[1]["losses"] and stock[0]["losses"] == stock[1]["losses"]
    assert g_loss[0] == s_loss[0]
    for g, s in zip(g_loss[1:], s_loss[1:]):
        assert abs(g - s) <= LOSS_TOL
        assert g != s  # the gradients went through e4m3, so the updates differ a little
    assert g_loss[-1] < g_loss[0]
