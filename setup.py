"""Build script for the optional native codec extension ``giftcomm._codec_native``.

Everything else about the package lives in pyproject.toml. The extension is plain C (native/*.c)
compiled with the flags below; it is *optional*: when no C compiler is available the build prints
a warning and the package installs without it (giftcomm.codec then uses the NumPy reference).

Flags and why (see docs/native.md):
  -O3                      auto-vectorization of the kernel loops
  -ffp-contract=off        no fused multiply-add: a*b+c must round twice, like NumPy does
  -fno-fast-math           IEEE semantics: no reassociation, no reciprocal division, no FTZ/DAZ
  -fno-trapping-math       FP exception flags are not observed, so gcc may if-convert the selects
                           (vblendvps) on AVX2/SSE; values and rounding are unchanged
  -std=c99                 plain portable C (gcc extensions only behind #if)
AVX2 / AVX-512 copies of the kernels are compiled inside the same file with `#pragma GCC target`
and chosen at run time, so no -march flag is needed and the binary runs on any x86-64.

A built extension is kept in build/native-cache/, named by a SHA-256 of what determines it (the
native/ sources and headers, this file, the compiler and its flags, the Python ABI): a second
`pip install -e .` of an unchanged checkout copies it instead of compiling again (a few seconds
instead of minutes); editing any of those inputs compiles afresh. `rm -rf build` empties the cache.
"""
import hashlib
import os
import shutil
import sys
import sysconfig
from glob import glob
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CACHE = HERE / "build" / "native-cache"

UNIX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c99", "-fvisibility=hidden"]
MSVC_FLAGS = ["/O2", "/fp:precise"]


class BuildExt(build_ext):
    """build_ext that picks the compiler flags by compiler family (gcc/clang vs MSVC) and reuses
    an extension built from the same inputs (build/native-cache/)."""

    def build_extensions(self) -> None:
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else UNIX_FLAGS
        for ext in self.extensions:
            ext.extra_compile_args = list(flags) + list(ext.extra_compile_args or [])
        super().build_extensions()

    def _cache_key(self, ext: Extension) -> str:
        """SHA-256 of everything the built file depends on: sources, headers, setup.py, the
        compiler command and flags, and the Python ABI (the extension's file suffix)."""
        h = hashlib.sha256()
        for path in sorted(set(ext.sources) | set(ext.depends or [])) + [__file__]:
            h.update(os.fsencode(os.path.relpath(path, HERE) if os.path.isabs(path) else path))
            h.update(Path(HERE, path).read_bytes())
        compiler = getattr(self.compiler, "compiler_so", None) or [self.compiler.compiler_type]
        for part in [*compiler, *ext.extra_compile_args, *(ext.extra_link_args or []), *(ext.define_macros or []),
                     sysconfig.get_config_var("EXT_SUFFIX") or "", sys.implementation.cache_tag or ""]:
            h.update(repr(part).encode() + b"\0")
        return h.hexdigest()

    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name))
        cached = CACHE / f"{ext.name}-{self._cache_key(ext)}{target.suffix}"
        if cached.is_file() and not self.force:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cached, target)
            print(f"{ext.name}: reused {cached.relative_to(HERE)} (sources, flags and compiler unchanged)")
            return
        super().build_extension(ext)
        if target.is_file():  # an optional extension that failed to build leaves none
            CACHE.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(".tmp")
            shutil.copy2(target, tmp)
            os.replace(tmp, cached)


setup(
    ext_modules=[
        Extension(
            "giftcomm._codec_native",
            sources=sorted(glob("native/*.c")),
            depends=sorted(glob("native/*.h")),
            include_dirs=["native"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
