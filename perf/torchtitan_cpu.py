"""torchtitan 0.3.0 on the CPU over gloo: the shims and the assets that perf/torchtitan_step.py and
the training test (tests/_torchtitan_cpu.py, tests/test_torchtitan_train.py) share. None of this
is in the library: giftcomm.recipes.torchtitan needs none of it on GPUs.

    import torchtitan_cpu                        # from perf/ (a script's directory is on sys.path)
    torchtitan_cpu.install()                     # before anything imports torchtitan
    tok, data = torchtitan_cpu.write_assets(folder)
    ...                                          # torchtitan builds its Trainer
    torchtitan_cpu.gloo_sum_unless_giftcomm(trainer.model_parts)

:func:`install` patches torchtitan 0.3.0 on torch 2.13 CPU:

- Triton: ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels every model's
  config registry imports) is a stub module whose kernels raise when called (none is, here).
- device type: torch's ``_get_available_device_type`` answers "cpu", so torchtitan picks
  ``torch.cpu`` as its device module and gloo as its backend.
- metrics: a memory monitor reporting zeros (``torch.cpu`` has no memory statistics).
- attention: FlexAttention has no backward on the CPU; its compiled call is replaced by dense
  SDPA with the block mask expanded (``create_mask``): the same attention, slower. The block
  mask itself is built eagerly (torchtitan compiles ``create_block_mask``: several seconds of
  tracing per process on the CPU, for a mask the dense attention expands anyway).
- barrier / timeouts: ``barrier(device_ids=...)`` drops ``device_ids`` (gloo rejects them) and
  ``set_pg_timeouts`` (after step 1; needs ``torch.distributed.set_timeout``, newer than 2.13)
  does nothing.
- the end of ``Trainer.train``: rank 0's 2 s sleep "for other ranks to complete" is skipped
  (whoever runs the trainer here synchronises the ranks before tearing the group down).

:func:`gloo_sum_unless_giftcomm`: gloo has no PREMUL_SUM, which FSDP2 uses with torchtitan's
gradient divide factor; FSDP modules of a model that carries no giftcomm comms (torchtitan's
stock run) reduce with SUM and scale after (torchtitan's factor, so the same mean). With giftcomm
the comm takes PREMUL_SUM itself.
"""
from __future__ import annotations

import json
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch._utils


def _stub_triton_kernels() -> None:
    name = "torchtitan.distributed.minimal_async_ep.kernels"

    def missing(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name}.{attr}: a Triton kernel, stubbed by the CPU shims (perf/torchtitan_cpu.py)")
        return kernel

    mod = types.ModuleType(name)
    mod.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = mod


def _dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None or return_aux.lse:
        raise NotImplementedError("the CPU shims' attention: no score_mod, no lse")
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, None


class _CPUMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        import torchtitan.components.metrics as metrics

        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


_installed = False


def install() -> None:
    """Apply the shims (once per process), before torchtitan is imported anywhere."""
    global _installed
    if _installed:
        return
    if "torchtitan.trainer" in sys.modules:
        raise RuntimeError("perf/torchtitan_cpu.install(): call it before torchtitan is imported")
    _stub_triton_kernels()
    torch._utils._get_available_device_type = lambda: "cpu"
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    import torchtitan.trainer as trainer
    from torch.nn.attention.flex_attention import create_block_mask

    attention.FlexAttention._compiled_flex_attn = _dense_attention  # type: ignore[assignment]
    attention._compiled_create_block_mask = create_block_mask  # type: ignore[assignment]
    metrics.build_device_memory_monitor = _CPUMemoryMonitor  # type: ignore[assignment]
    barrier = torch.distributed.barrier

    def cpu_barrier(*args, device_ids=None, **kwargs):
        return barrier(*args, **kwargs)

    torch.distributed.barrier = cpu_barrier  # type: ignore[assignment]
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None  # type: ignore[assignment]
    trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda seconds: None)  # type: ignore[assignment]
    _installed = True


def gloo_sum_unless_giftcomm(model_parts: list[torch.nn.Module]) -> None:
    """FSDP2 reduces with SUM, then scales, on every FSDP module of a part without
    ``giftcomm_comms`` (giftcomm.recipes.torchtitan's mark); parts with it are left alone."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        if getattr(part, "giftcomm_comms", None) is None:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)


def write_assets(root: Path, texts: int = 200) -> tuple[Path, Path]:
    """Under ``root``: a word-level tokenizer (``tokenizer/``: tokenizer.json and
    tokenizer_config.json, 1003 tokens) and a JSON-lines data set (``data/train.jsonl``:
    ``texts`` texts of 50-300 of its words, 80% from the 50 commonest; seeded, the same every
    run). Returns the two folders (torchtitan's ``--hf_assets_path`` and
    ``--dataloader.dataset_path``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir(parents=True)
    data_dir.mkdir()
    words = [f"w{i}" for i in range(1000)]
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": True}))
    rng = random.Random(0)
    with open(data_dir / "train.jsonl", "w") as f:
        for _ in range(texts):
            text = " ".join(rng.choice(words[:50]) if rng.random() < 0.8 else rng.choice(words)
                            for _ in range(rng.randint(50, 300)))
            f.write(json.dumps({"text": text}) + "\n")
    return tok_dir, data_dir


def flags(tok: Path, data: Path, dump: Path, dp_shard: int = 2) -> list[str]:
    """The torchtitan flags every CPU run here takes: FSDP2 at ``dp_shard`` over the
    partial-DTensor SPMD backend, seed 0, the assets of :func:`write_assets`, no checkpoint, no
    validation."""
    return ["--parallelism.data_parallel_shard_degree", str(dp_shard), "--parallelism.spmd_backend", "partial_dtensor",
            "--debug.seed", "0", "--hf_assets_path", str(tok), "--dataloader.dataset_path", str(data),
            "--dump_folder", str(dump), "--checkpoint.no-enable", "--validator.no-enable"]


def report(trainer: Any) -> dict[str, Any]:
    """The giftcomm comms on the trainer's model: their number (None when it has none) and
    ``stats()``."""
    comms = getattr(trainer.model_parts[0], "giftcomm_comms", None)
    return {"comms": None if comms is None else len(comms), "stats": None if comms is None else comms.stats()}
