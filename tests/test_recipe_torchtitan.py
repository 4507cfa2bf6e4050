"""giftcomm.recipes.torchtitan without torchtitan (its own trainer runs the recipe in
tests/test_torchtitan_train.py): the GIFTCOMM_* options, the module's answer to torchtitan's
config lookup (against a stand-in of torchtitan's model registry, including registries that fail
to import) and the wrapped ``parallelize_fn``. Training through it -- FSDP2 calling the comm with
PREMUL_SUM, as torchtitan's gradient divide factor makes it -- is the real trainer's test."""
from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Callable

import pytest
import torch
from conftest import UNKNOWN_FORMAT

from giftcomm.recipes.torchtitan import options_from_env


def test_options_from_env_parse_and_validate():
    assert options_from_env({"GIFTCOMM_FMT": "e5m2", "GIFTCOMM_BLOCK": "128", "GIFTCOMM_ALLOW_NATIVE": "0"}) == \
        {"fmt": "e5m2", "block": 128, "allow_native": False}
    assert options_from_env({}) == {}
    with pytest.raises(ValueError, match="GIFTCOMM_BLOCK"):
        options_from_env({"GIFTCOMM_BLOCK": "x"})
    with pytest.raises(ValueError, match="GIFTCOMM_"):
        options_from_env({"GIFTCOMM_FMT": UNKNOWN_FORMAT})


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


def _fake_torchtitan(monkeypatch, broken=()):
    """A stand-in for torchtitan's model registry (only what the recipe reads): models "toy" and
    "other" (their config_registry modules; those named in ``broken`` fail to import, as 0.3's
    do without Triton), "toy" defining ``toy_debugmodel``."""
    models = types.ModuleType("torchtitan.models")
    models._supported_models = {"toy", "other", *broken}
    monkeypatch.setitem(sys.modules, "torchtitan", types.ModuleType("torchtitan"))
    monkeypatch.setitem(sys.modules, "torchtitan.models", models)
    toy = types.ModuleType("torchtitan.models.toy.config_registry")
    toy.toy_debugmodel = lambda: _Config(_Spec("toy", _stock_parallelize))
    monkeypatch.setitem(sys.modules, toy.__name__, toy)
    monkeypatch.setitem(sys.modules, "torchtitan.models.other.config_registry",
                        types.ModuleType("torchtitan.models.other.config_registry"))
    for name in broken:
        monkeypatch.setitem(sys.modules, f"torchtitan.models.{name}.config_registry", None)  # import raises


def test_module_answers_torchtitans_config_lookup(monkeypatch):
    """What torchtitan's ConfigManager does with ``--module giftcomm.recipes.torchtitan --config
    NAME``: import ``<module>.config_registry`` (must fail, so it falls back to the module), then
    ``getattr(module, NAME, None)`` and call it."""
    import giftcomm.recipes.torchtitan as recipe

    toy, nope = "toy_debugmodel", "nope"  # names as torchtitan's getattr gets them
    _fake_torchtitan(monkeypatch)
    with pytest.raises(ImportError):
        importlib.import_module("giftcomm.recipes.torchtitan.config_registry")
    monkeypatch.setenv("GIFTCOMM_FMT", "e5m2")
    cfg = getattr(recipe, toy)()
    assert cfg.model_spec.name == "toy" and cfg.model_spec.parallelize_fn.__wrapped__ is _stock_parallelize
    assert getattr(recipe, nope, None) is None  # torchtitan then reports "config not found"
    assert getattr(recipe, "_private", None) is None
    monkeypatch.setenv("GIFTCOMM_FMT", UNKNOWN_FORMAT)  # validated when the config loads, naming the variable
    with pytest.raises(ValueError, match="GIFTCOMM_"):
        getattr(recipe, toy)
    monkeypatch.delenv("GIFTCOMM_FMT")
    _fake_torchtitan(monkeypatch, broken=("needs_triton",))
    assert callable(getattr(recipe, toy))  # another model's broken registry does not matter
    with pytest.raises(ImportError, match="needs_triton"):  # but is named when no model has the config
        getattr(recipe, nope)
