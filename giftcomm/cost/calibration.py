"""The calibration file: where it is, reading it (checked, re-read when it changes) and writing it.

The cost model's constants (giftcomm.algorithms.machine.Calibration: seconds per message, seconds per byte
per link class, codec values per second) come from a small JSON file written by
``python -m giftcomm.perf calibrate``: the file named by the environment variable
GIFTCOMM_CALIBRATION, else $XDG_CACHE_HOME/giftcomm/calibration.json
(~/.cache/giftcomm/calibration.json when XDG_CACHE_HOME is unset), else the built-in calibration
(giftcomm.algorithms.machine.BUILT_IN: measured on a 2-core development VM over MPICH shared memory; a
10 Gbit/s network link for "net"). A file that cannot be used -- unreadable, not a regular file, too large, not JSON, missing
fields, values that are not finite numbers within giftcomm.algorithms.machine.BOUNDS -- gives one warning naming the
file and the reason, and the built-in defaults are used (never an exception: the file is read
while planning every ``algorithm="auto"`` call, on every rank).

giftcomm.cost.model predicts with the calibration in force (and re-exports the functions here).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import stat
import tempfile
import time
import warnings
from pathlib import Path

from .. import config
from ..algorithms.machine import BUILT_IN, Calibration

__all__ = ["MAX_FILE_BYTES", "calibration_path", "load_calibration", "in_force", "forget_calibration",
           "write_calibration"]

MAX_FILE_BYTES = 1 << 20
"""A calibration file is a few hundred bytes (plus the raw measurements): larger ones are refused."""


def calibration_path() -> Path:
    """Where the calibration file is read from (and written to by the calibrate command)."""
    return Path(_calibration_file())


def _calibration_file() -> str:
    # plain strings: pathlib costs ~0.1 ms
    return (config.path("GIFTCOMM_CALIBRATION")
            or _default_calibration_file(os.environ.get("XDG_CACHE_HOME", ""), os.environ.get("HOME")))


@functools.lru_cache(maxsize=8)
def _default_calibration_file(xdg_cache: str, home: str | None) -> str:
    """giftcomm/calibration.json under $XDG_CACHE_HOME when it is an absolute path (the XDG base
    directory rule: relative values are ignored), else under ~/.cache (``home``: $HOME; the
    password entry's home when unset, as expanduser). Cached: expanduser costs ~10 us a call."""
    if xdg_cache and os.path.isabs(xdg_cache):
        return os.path.join(xdg_cache, "giftcomm", "calibration.json")
    return os.path.join(home or os.path.expanduser("~"), ".cache", "giftcomm", "calibration.json")


_cached: tuple[str, tuple, Calibration] | None = None
_BUILT_IN = BUILT_IN  # returned while no file exists; shared, so never modify what you get
log = logging.getLogger("giftcomm")


_RECHECK_S = 1.0  # "auto" asks on every call: stat the same file at most once a second
_last: tuple[str, float, Calibration] | None = None


def load_calibration() -> Calibration:
    """The calibration in force (re-read when the file changes, noticed within a second, or at
    once when the path changes or :func:`write_calibration` wrote it; the built-in defaults
    without one, or with one that cannot be used: then one warning naming the file and why).

    The object is shared by every caller: copy it (``build_calibration``) before changing it."""
    global _last
    path = _calibration_file()
    now = time.monotonic()
    if _last is not None and _last[0] == path and now - _last[1] < _RECHECK_S:
        return _last[2]
    cal = _load_calibration(path)
    _last = (path, now, cal)
    return cal


def in_force() -> Calibration:
    """:func:`load_calibration` for the per-call path of ``auto`` (giftcomm.cost.model.choose): at
    most once a second; in between, the calibration it gave last, without reading the
    environment or the file (so a changed GIFTCOMM_CALIBRATION, like a changed file, is noticed
    within a second)."""
    last = _last
    if last is not None and time.monotonic() - last[1] < _RECHECK_S:
        return last[2]
    return load_calibration()


def forget_calibration() -> None:
    """Make the next :func:`load_calibration` look at the file now (after writing it, or after
    changing GIFTCOMM_CALIBRATION)."""
    global _last
    _last = None


def _load_calibration(path: str) -> Calibration:
    global _cached
    try:
        st = os.stat(path)
    except OSError:
        return _BUILT_IN
    key = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
    if _cached is None or _cached[0] != path or _cached[1] != key:
        try:
            cal = _read_calibration(path, st)
            cal.source = path
        except Exception as exc:  # noqa: BLE001 - any bad file means: defaults, and say so once
            cal = _BUILT_IN
            msg = (f"giftcomm: ignoring the calibration file {path}: {exc}; the cost model uses its built-in "
                   f"constants (rewrite it with `python -m giftcomm.perf calibrate`, or point "
                   f"GIFTCOMM_CALIBRATION elsewhere)")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        _cached = (path, key, cal)
    return _cached[2]


def _read_calibration(path: str, st: os.stat_result) -> Calibration:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError("not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise ValueError(f"{st.st_size} bytes, more than the {MAX_FILE_BYTES} a calibration file may have")
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"more than {MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    return Calibration.from_dict(doc)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a usable calibration value")


def write_calibration(path: str | os.PathLike, text: str) -> None:
    """Write a calibration file atomically: a temporary file in the same directory, flushed to
    disk, then renamed over ``path`` (a reader sees the old file or the new one, never a part)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        forget_calibration()
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
