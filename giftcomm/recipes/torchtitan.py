"""torchtitan with giftcomm's FSDP2 reduce-scatter, without a fork: a config module.

::

    GIFTCOMM_FMT=e4m3 torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module giftcomm.recipes.torchtitan --config llama3_8b [torchtitan's own flags ...]

torchtitan (0.3) loads ``--config NAME`` as a function of the ``--module`` package. This module
answers any NAME that one of torchtitan's models defines in its ``config_registry``
(``llama3_debugmodel``, ``llama3_8b``, ``qwen3_...``): it returns that config with the model
spec's ``parallelize_fn`` wrapped -- torchtitan's own parallelisation runs first, then
:func:`giftcomm.adapters.torch.register_reduce_scatter` installs giftcomm's reduce-scatter on
every FSDP2 module it made (a model without FSDP modules, e.g. dp_shard = 1, is left alone).
torchtitan sets FSDP's gradient divide factor, so FSDP2 calls the comm with PREMUL_SUM, which
the comm maps to giftcomm's sum times the factor.

The call options come from the environment (torchtitan's command line parser accepts only its
own flags): ``GIFTCOMM_FMT``, ``GIFTCOMM_BLOCK``, ``GIFTCOMM_ROUNDING``, ``GIFTCOMM_SEED``,
``GIFTCOMM_ALGORITHM``, ``GIFTCOMM_SLICE_ELEMS``, ``GIFTCOMM_CALL_TIMEOUT``,
``GIFTCOMM_ALLOW_NATIVE`` (0/1), ``GIFTCOMM_WARMUP``, ``GIFTCOMM_ERROR_FEEDBACK`` (0/1); see
:class:`giftcomm.adapters.torch.GiftReduceScatter`. They are read and validated when the config
is loaded (a bad one raises there, naming the variable).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["options_from_env", "with_giftcomm"]

_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "GIFTCOMM_FMT": ("fmt", str),
    "GIFTCOMM_BLOCK": ("block", int),
    "GIFTCOMM_ROUNDING": ("rounding", str),
    "GIFTCOMM_SEED": ("seed", int),
    "GIFTCOMM_ALGORITHM": ("algorithm", str),
    "GIFTCOMM_SLICE_ELEMS": ("slice_elems", int),
    "GIFTCOMM_CALL_TIMEOUT": ("timeout", float),
    "GIFTCOMM_ALLOW_NATIVE": ("allow_native", lambda v: _flag(v)),
    "GIFTCOMM_WARMUP": ("warmup", int),
    "GIFTCOMM_ERROR_FEEDBACK": ("error_feedback", lambda v: _flag(v)),
}


_SCHEDULE_KNOBS = ("warmup", "error_feedback")
"""The variables' names that are knobs of the comms' GiftSchedule (the rest are call options)."""


def _flag(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"must be 0 or 1, got {value!r}")
    return value == "1"


def options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The GiftReduceScatter options the GIFTCOMM_* variables of ``env`` (default os.environ)
    give, validated by building one comm; ValueError naming the variable for a bad value. The
    warm-up and error feedback come as one ``schedule`` (the comms' default schedule with them)."""
    from ..adapters.torch import GiftReduceScatter
    from ..adapters.torch.fsdp import SCHEDULE

    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    knobs: dict[str, Any] = {}
    for var, (name, parse) in _ENV.items():
        if var in env:
            try:
                (knobs if name in _SCHEDULE_KNOBS else opts)[name] = parse(env[var])
            except ValueError as exc:
                raise ValueError(f"{var}: {exc}") from None
    try:
        if knobs:
            opts["schedule"] = SCHEDULE.replace(**knobs)
        GiftReduceScatter(**opts)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"giftcomm.recipes.torchtitan: the GIFTCOMM_* environment: {exc}") from None
    return opts


def with_giftcomm(config: Any, **options: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with its model spec's ``parallelize_fn``
    followed by ``register_reduce_scatter(model, **options)``; the comms are kept on the model
    as ``model.giftcomm_comms``."""
    spec = config.model_spec
    stock = spec.parallelize_fn

    def parallelize(model: Any, *args: Any, **kwargs: Any) -> Any:
        from ..adapters.torch import register_reduce_scatter
        from ..adapters.torch.fsdp import fsdp_modules

        out = stock(model, *args, **kwargs)
        target = model if out is None else out
        if fsdp_modules(target):
            target.giftcomm_comms = register_reduce_scatter(target, **options)
        return out

    parallelize.__wrapped__ = stock  # type: ignore[attr-defined]
    config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize)
    return config


def _find(name: str) -> Callable[[], Any] | None:
    """torchtitan's config function ``name`` from its models' config registries, or None when
    none defines it. ImportError when none defines it and some registries failed to import
    (torchtitan 0.3's import Triton kernels: naming them beats "config not found")."""
    from torchtitan.models import _supported_models

    failed: dict[str, str] = {}
    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError as exc:
            failed[model] = f"{type(exc).__name__}: {exc}"
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            return fn
    if failed:
        raise ImportError(f"giftcomm.recipes.torchtitan: no importable torchtitan model defines {name!r}; these "
                          f"models' config registries failed to import: {failed}")
    return None


def __getattr__(name: str) -> Any:
    """torchtitan's ``getattr(module, config_name)``: the named config with giftcomm's comm."""
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _find(name)
    if fn is None:
        raise AttributeError(f"giftcomm.recipes.torchtitan: torchtitan has no config function {name!r}")
    options = options_from_env()

    def config() -> Any:
        return with_giftcomm(fn(), **options)

    config.__name__ = name
    return config
