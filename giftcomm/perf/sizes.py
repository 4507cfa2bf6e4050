"""Parsing and printing byte sizes the way nccl-tests does (1K, 4M, 1G; powers of 1024)."""
from __future__ import annotations

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'64M' -> 67108864; plain integers are bytes."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = s[-1] if s and s[-1] in _UNITS else ""
    try:
        return int(float(s[: len(s) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 1024, 1K, 64M, 1G)") from None


def format_size(nbytes: int) -> str:
    """67108864 -> '64M'; sizes that are not whole units print as bytes."""
    for unit in ("G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def size_range(begin: int, end: int, factor: float) -> list[int]:
    """begin, begin*factor, ... up to end inclusive (nccl-tests' -b/-e/-f)."""
    if begin <= 0 or end < begin or factor <= 1:
        raise ValueError("need 0 < begin <= end and factor > 1")
    sizes: list[int] = []
    s = float(begin)
    while s <= end:
        sizes.append(int(s))
        s *= factor
    return sizes
