"""Byte-level text corpus from the Python standard library's own ``.py`` sources (offline).

Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``,
``dist-packages``, test suites (``test``/``tests``/``idle_test`` folders) and ``__pycache__``,
sorted by their path relative to the stdlib root (deterministic for a given Python version).
A file goes to the validation split when the BLAKE2b hash of its relative path, mod 100, is
below ``val_percent``; the split therefore does not depend on the file list's order or size.
Tokens are the file's bytes (vocabulary 256); files are joined with a NUL byte between them.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

__all__ = ["Corpus", "stdlib_files", "load_corpus", "VOCAB_SIZE"]

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the corpus files under ``root`` (default: the stdlib)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
        out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return sorted(out)


def _is_val(rel: str, val_percent: int) -> bool:
    h = hashlib.blake2b(rel.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 100 < val_percent


@dataclass
class Corpus:
    """train/val: uint8 token arrays (1-D); files: (train count, val count); digest: BLAKE2b
    hex of all tokens (identifies the corpus in logs)."""

    train: np.ndarray
    val: np.ndarray
    files: tuple[int, int]
    digest: str

    def batch(self, split: str, starts: np.ndarray, seq_len: int) -> np.ndarray:
        """int64 array (len(starts), seq_len + 1): windows of the split starting at ``starts``."""
        data = self.train if split == "train" else self.val
        idx = np.asarray(starts, np.int64)[:, None] + np.arange(seq_len + 1)
        return data[idx].astype(np.int64)


def load_corpus(root: str | None = None, val_percent: int = 5, max_bytes: int | None = None) -> Corpus:
    """Read the corpus (see module doc). max_bytes caps each split (for quick runs)."""
    root = root or sysconfig.get_paths()["stdlib"]
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    for rel in stdlib_files(root):
        split = "val" if _is_val(rel, val_percent) else "train"
        if max_bytes is not None and sizes[split] >= max_bytes:
            continue
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read() + b"\0"
        parts[split].append(data)
        sizes[split] += len(data)
    arrays = {}
    for split, chunks in parts.items():
        buf = b"".join(chunks)
        if max_bytes is not None:
            buf = buf[:max_bytes]
        arrays[split] = np.frombuffer(buf, np.uint8)
    h = hashlib.blake2b(digest_size=8)
    h.update(arrays["train"].tobytes())
    h.update(arrays["val"].tobytes())
    return Corpus(arrays["train"], arrays["val"], (len(parts["train"]), len(parts["val"])), h.hexdigest())
