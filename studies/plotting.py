"""Plotting helpers every study shares: matplotlib without a display, one figure style, one way
to save (needs matplotlib: ``pip install -e '.[studies]'``)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 110


def pyplot() -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (works without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | Path, dpi: int = DPI) -> None:
    """Lay out, write ``path`` (PNG) and close ``fig``."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def sibling(path: str | Path, suffix: str) -> Path:
    """``report.md`` -> ``report.png`` (the file a study writes beside its report)."""
    return Path(path).with_suffix(suffix)
