"""Studies about giftcomm: tools that measure and explain the library, kept beside tests/ and out
of the installed package (``python -m studies <command>`` from a source checkout).

The installed package keeps what a user imports and the benchmark a user runs
(``python -m giftcomm.perf allreduce | codec | calibrate``). Here live the training comparison,
the fidelity and error studies, the cost model's validation and projection, the multi-host
netbed, the plots and the GPU device check. Extra dependencies: ``pip install -e '.[studies]'``.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the source checkout holding studies/


def subprocess_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the checkout on PYTHONPATH, so that a
    child ``python -m studies.<module>`` finds this package from any working directory."""
    out = dict(os.environ if env is None else env)
    parts = [str(ROOT)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out
