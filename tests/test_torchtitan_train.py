"""torchtitan's own trainer (``torchtitan.train.main``, torchtitan 0.3.0) trains its Llama-3
debug model (``llama3_debugmodel``: 6 layers, dim 256, vocabulary 2048) for 3 steps of FSDP2 at
dp_shard = 2 over gloo on the CPU, once through ``--module giftcomm.recipes.torchtitan``
(GIFTCOMM_FMT=e4m3) and once through torchtitan's stock config, both under torchrun.

Asserted: with giftcomm, every rank's model carries the comms the recipe installed (one per FSDP2
module: the 6 blocks, and the root's) and they sent e4m3 bytes on every step; the losses agree
across the two runs within ``LOSS_TOL`` (step 1's exactly: its loss comes before any gradient
was reduced; steps 2-3 see one or two AdamW updates made from e4m3-rounded gradients, which moved
the loss by <= 5e-5 in the runs of 2026-12-06); the loss falls.

torchtitan's wheel ships no assets, so the test writes a word-level tokenizer (1003 tokens) and a
small JSON-lines text set to ``tmp_path``. The CPU shims live in tests/_torchtitan_cpu.py (the
launcher torchrun runs in place of ``-m torchtitan.train``), never in the library.

Not part of the suite (the file name keeps pytest from collecting it): torchtitan is not in the
test extra (docs/adapters.md, torchtitan). Run it where torchtitan 0.3.0 is installed:
``pip install torchtitan==0.3.0 && python -m pytest tests/torchtitan_train_check.py -q``.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torchtitan  # noqa: F401  (needed: this check exists to run it)

STEPS = 3
LOSS_TOL = 2e-3  # |giftcomm loss - stock loss| per step after the first (measured: <= 5e-5)
HERE = Path(__file__).resolve().parent


def _assets(root: Path) -> tuple[Path, Path]:
    """A word-level tokenizer (tokenizer.json + tokenizer_config.json) and a JSON-lines data set
    whose texts are made of its words (seeded: the same every run)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir()
    data_dir.mkdir()
    words = [f"w{i}" for i in range(1000)]
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": True}))
    rng = random.Random(0)
    with open(data_dir / "train.jsonl", "w") as f:
        for _ in range(200):
            text = " ".join(rng.choice(words[:50]) if rng.random() < 0.8 else rng.choice(words)
                            for _ in range(rng.randint(50, 300)))
            f.write(json.dumps({"text": text}) + "\n")
    return tok_dir, data_dir


def _train(root: Path, tok: Path, data: Path, gift: bool) -> list[dict]:
    """Every rank's report (losses, giftcomm comm count and stats) of one torchrun launch."""
    out = root / ("gift" if gift else "stock")
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIFTCOMM_")}
    env.update(TITAN_TEST_REPORT=str(out), PYTHONPATH=os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    if gift:
        env["GIFTCOMM_FMT"] = "e4m3"
    else:
        env["TITAN_TEST_GLOO_SUM"] = "1"  # gloo has no PREMUL_SUM: SUM, then FSDP's own scaling
    module = ["--module", "giftcomm.recipes.torchtitan"] if gift else ["--module", "llama3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "_torchtitan_cpu.py"), *module, "--config", "llama3_debugmodel",
           "--training.steps", str(STEPS), "--training.seq_len", "256", "--training.local_batch_size", "2",
           "--parallelism.data_parallel_shard_degree", "2", "--parallelism.spmd_backend", "partial_dtensor",
           "--debug.seed", "0", "--hf_assets_path", str(tok), "--dataloader.dataset_path", str(data),
           "--dump_folder", str(out / "dump"), "--checkpoint.no-enable", "--validator.no-enable"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_torchtitan_debug_model_trains_with_giftcomm(tmp_path):
    tok, data = _assets(tmp_path)
    gift = _train(tmp_path, tok, data, True)
    stock = _train(tmp_path, tok, data, False)
    for rep in stock:
        assert rep["comms"] is None
    for rep in gift:
        assert rep["comms"] == 9  # one GiftReduceScatter per FSDP2 module
        stats = rep["stats"]
        assert stats["calls"] == 9 * STEPS
        assert stats["bytes_sent"].get("e4m3", 0) > 0
    g_loss = [loss for _, loss, _ in gift[0]["losses"]]
    s_loss = [loss for _, loss, _ in stock[0]["losses"]]
    assert [s for s, _, _ in gift[0]["losses"]] == list(range(1, STEPS + 1))
    assert gift[0]["losses"] == gift[1]["losses"] and stock[0]["losses"] == stock[1]["losses"]
    assert g_loss[0] == s_loss[0]
    for g, s in zip(g_loss[1:], s_loss[1:]):
        assert abs(g - s) <= LOSS_TOL
        assert g != s  # the gradients went through e4m3, so the updates differ a little
    assert g_loss[-1] < g_loss[0]
