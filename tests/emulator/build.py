"""Build the CUDA source text (what giftcomm.cuda._loader gives NVRTC) as a host shared library
against simt.h, cached by a hash of everything that goes in.

``build(code, asan=False)`` returns a :class:`Built`: the loaded library and, per kernel, its
parameter signature (from the compiler: template deduction on the kernel's function type, see
simt.h ``gcemu::signature``) and its ``__launch_bounds__`` maximum threads. Kernel names and
bounds come from the preprocessed source (``extern "C" __global__ void __launch_bounds__(N) name(``).

Cache: ``$GIFTCOMM_EMU_CACHE`` or ``~/.cache/giftcomm/emulator``; one library per hash.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM = HERE / "simt.h"
CXX = os.environ.get("CXX", "g++")
# -ffp-contract=off: no FMA contraction (NVRTC gets --fmad=false); no -ffast-math anywhere
FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing", "-w")
# AddressSanitizer, plus UBSan's alignment check: a float4 / uint4 / 8- or 4-byte word accessed at an
# address not aligned for it is a fault on the GPU (misaligned address), so it must fail here too
ASAN_FLAGS = ("-g", "-fsanitize=address,alignment", "-fno-sanitize-recover=alignment", "-fno-omit-frame-pointer")
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\(\s*(\d+)[^)]*\)\s*)?(\w+)\s*\(')
_lock = threading.Lock()
_loaded: dict[str, "Built"] = {}


@dataclass
class Built:
    lib: Any
    path: Path
    kernels: dict[str, tuple[str, int]]  # name -> (signature, max threads per block)


def available() -> bool:
    return shutil.which(CXX) is not None


def cache_dir() -> Path:
    d = Path(os.environ.get("GIFTCOMM_EMU_CACHE", Path.home() / ".cache" / "giftcomm" / "emulator"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def kernel_table(code: str) -> dict[str, int]:
    """name -> __launch_bounds__ max threads (1024 when none) of every kernel, from the source
    preprocessed the way NVRTC sees it (macros expanded)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(code)
        out = subprocess.run([CXX, "-E", "-P", "-x", "c++", "-D__CUDACC_RTC__", "-D__CUDA_ARCH__=900", str(src)],
                             capture_output=True, text=True, check=True).stdout
    return {m.group(2): int(m.group(1) or 1024) for m in _KERNEL.finditer(out)}


def _wrapper(names: list[str]) -> str:
    rows = ",\n".join(
        f'    {{"{n}", [](const unsigned* g, const unsigned* b, void** a) {{ return gcemu::launch_kernel(&{n}, g, b, a); }}, '
        f"gcemu::signature(&{n})}}" for n in names)
    return f"""#include "simt.h"
#include "kernels.cu"
#include <string>
namespace {{
struct Entry {{ const char* name; int (*launch)(const unsigned*, const unsigned*, void**); std::string sig; }};

const Entry entries[] = {{
{rows}
}};
}}
extern "C" int gcemu_count() {{ return (int)(sizeof entries / sizeof entries[0]); }}
extern "C" const char* gcemu_name(int i) {{ return entries[i].name; }}
extern "C" const char* gcemu_signature(int i) {{ return entries[i].sig.c_str(); }}
extern "C" const char* gcemu_error() {{ return gcemu::S().msg; }}
extern "C" int gcemu_launch(const char* name, const unsigned* g, const unsigned* b, void** a) {{
    for (const Entry& e : entries)
        if (!strcmp(e.name, name)) return e.launch(g, b, a);
    snprintf(gcemu::S().msg, sizeof gcemu::S().msg, "no kernel %s", name);
    return 1;
}}
"""


def build(code: str, asan: bool = False) -> Built:
    """Compile (or take from the cache) and load the library of CUDA source ``code``."""
    flags = FLAGS + (ASAN_FLAGS if asan else ())
    h = hashlib.sha256("\0".join((code, SHIM.read_text(), " ".join(flags), CXX, Path(__file__).read_text())).encode())
    key = h.hexdigest()[:20] + ("-asan" if asan else "")
    with _lock:
        if key in _loaded:
            return _loaded[key]
        bounds = kernel_table(code)
        d = cache_dir() / key
        so = d / "kernels.so"
        if not so.is_file():
            tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
            (tmp / "kernels.cu").write_text(code)
            shutil.copy(SHIM, tmp / "simt.h")
            (tmp / "main.cpp").write_text(_wrapper(sorted(bounds)))
            r = subprocess.run([CXX, *flags, "-I", str(tmp), str(tmp / "main.cpp"), "-o", str(tmp / "kernels.so")],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"host build of the CUDA source failed:\n{r.stderr[-4000:]}")
            try:
                tmp.rename(d)
            except OSError:  # another process built it first
                shutil.rmtree(tmp, ignore_errors=True)
        lib = ctypes.CDLL(str(so))
        lib.gcemu_launch.restype = ctypes.c_int
        lib.gcemu_launch.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.gcemu_error.restype = ctypes.c_char_p
        lib.gcemu_name.restype = ctypes.c_char_p
        lib.gcemu_signature.restype = ctypes.c_char_p
        sigs = {lib.gcemu_name(i).decode(): lib.gcemu_signature(i).decode() for i in range(lib.gcemu_count())}
        built = _loaded[key] = Built(lib, so, {n: (sigs[n], bounds[n]) for n in sigs})
        return built
