"""giftcomm.recipes.torchtitan without torchtitan installed (not in the test extra: see
docs/adapters.md): the GIFTCOMM_* options and the wrapped ``parallelize_fn`` over a real FSDP2
model at P = 2 (gloo), whose gradient divide factor makes FSDP2 call the comm with PREMUL_SUM as
torchtitan does."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from test_torchrun import _spawn

from giftcomm.recipes.torchtitan import options_from_env, with_giftcomm


def test_options_from_env_parse_and_validate():
    assert options_from_env({"GIFTCOMM_FMT": "e5m2", "GIFTCOMM_BLOCK": "128", "GIFTCOMM_ALLOW_NATIVE": "0"}) == \
        {"fmt": "e5m2", "block": 128, "allow_native": False}
    assert options_from_env({}) == {}
    with pytest.raises(ValueError, match="GIFTCOMM_BLOCK"):
        options_from_env({"GIFTCOMM_BLOCK": "x"})
    with pytest.raises(ValueError, match="GIFTCOMM_"):
        options_from_env({"GIFTCOMM_FMT": "e9m9"})


@dataclasses.dataclass
class _Spec:  # the fields of torchtitan's ModelSpec the recipe touches
    name: str
    parallelize_fn: Callable


@dataclasses.dataclass
class _Config:
    model_spec: _Spec


def _stock_parallelize(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(2.0)  # torchtitan's: FSDP2 then reduces with PREMUL_SUM(1/2)
    return model


def _worker(rank, world, gift):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 16))
    cfg = _Config(_Spec("toy", _stock_parallelize))
    if gift:
        cfg = with_giftcomm(cfg, fmt="e4m3", algorithm="ring")
    model = cfg.model_spec.parallelize_fn(model)
    g = torch.Generator().manual_seed(rank)
    torch.nn.functional.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 16, generator=g)).backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    return grads, [c.calls for c in getattr(model, "giftcomm_comms", [])]


def test_wrapped_parallelize_installs_the_comm(tmp_path):
    gift = _spawn(_worker, 2, tmp_path, True)
    (tmp_path / "plain").mkdir()
    plain = _spawn(_worker, 2, tmp_path / "plain", False)
    for r in range(2):
        assert gift[r][1] and all(c == 1 for c in gift[r][1])  # every FSDP module's comm ran once
        for g, p in zip(gift[r][0], plain[r][0]):
            assert (g - p).abs().max() <= 0.125 * p.abs().max()
            assert g.numel() < 64 or not torch.equal(g, p)
