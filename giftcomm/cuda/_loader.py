"""Finding, preparing and compiling the CUDA sources (CuPy ``RawModule`` over NVRTC).

The sources live next to this file in ``kernels/`` and are package data, so they are found after
``pip install -e .`` and after a normal install alike (pyproject: ``[tool.setuptools.package-data]
"giftcomm.cuda" = ["kernels/*.cu", "kernels/*.cuh"]``).

What NVRTC compiles is the ``.cu`` file with its local ``#include "x.cuh"`` lines replaced by the
header text, each piece preceded by a ``#line N "/absolute/path"`` directive: compiler errors name
the real file and line, and CuPy's kernel cache (keyed on the source text and the options) sees
every change of every header. Each module is compiled once per device per process (then cached
here; CuPy also keeps the compiled binary on disk under ``~/.cupy/kernel_cache``).

``python -m giftcomm.cuda._loader --list`` prints the module names; ``--dump NAME`` prints the
text NVRTC gets (native/check_cuda.sh compiles it with nvcc).
"""
from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

#: module name -> source file in KERNEL_DIR
MODULES: dict[str, str] = {"codec": "gc_codec.cu"}

#: NVRTC options. IEEE float32: no FMA contraction, no flush-to-zero, correctly rounded division
#: (the kernels also use the _rn intrinsics, so this is belt and braces).
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}


def source_path(name: str) -> Path:
    """Absolute path of a module's ``.cu`` file; FileNotFoundError naming the folder searched."""
    try:
        path = KERNEL_DIR / MODULES[name]
    except KeyError:
        raise ValueError(f"unknown CUDA module {name!r}; known: {', '.join(MODULES)}") from None
    if not path.is_file():
        raise FileNotFoundError(f"CUDA source {path} is missing: the package data was not installed")
    return path


def _expand(path: Path, seen: tuple[Path, ...]) -> list[str]:
    if path in seen:
        raise ValueError(f"include cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    out = [f'#line 1 "{path}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if m:
            inc = (path.parent / m.group(1)).resolve()
            if not inc.is_file():
                raise FileNotFoundError(f"{path}:{lineno}: included file {inc} not found")
            out.extend(_expand(inc, seen + (path,)))
            out.append(f'#line {lineno + 1} "{path}"')
        elif line.strip() == "#pragma once":
            out.append("")
        else:
            out.append(line)
    return out


def source_text(name: str) -> str:
    """The text NVRTC compiles for module ``name``: local includes inlined, with #line directives."""
    return "\n".join(_expand(source_path(name), ())) + "\n"


def get_module(name: str = "codec") -> Any:
    """The compiled ``cupy.RawModule`` of ``name`` for the current device (compiled on first use)."""
    import cupy

    key = (name, cupy.cuda.Device().id)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cupy.RawModule(code=source_text(name), options=NVRTC_OPTIONS, backend="nvrtc")
                mod.compile()  # compile now, so that errors surface here and not at first launch
                _modules[key] = mod
    return mod


_functions: dict[tuple[str, str, int], Any] = {}


def get_function(kernel: str, module: str = "codec") -> Any:
    """A kernel (``cupy.RawKernel``) of a module, for the current device."""
    import cupy

    key = (module, kernel, cupy.cuda.Device().id)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = get_module(module).get_function(kernel)
    return fn


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--list"]:
        print("\n".join(MODULES))
        return 0
    if len(argv) == 2 and argv[0] == "--dump":
        sys.stdout.write(source_text(argv[1]))
        return 0
    print("usage: python -m giftcomm.cuda._loader --list | --dump NAME", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
