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
"""
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

UNIX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c99", "-fvisibility=hidden"]
MSVC_FLAGS = ["/O2", "/fp:precise"]


class BuildExt(build_ext):
    """build_ext that picks the compiler flags by compiler family (gcc/clang vs MSVC)."""

    def build_extensions(self) -> None:
        flags = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else UNIX_FLAGS
        for ext in self.extensions:
            ext.extra_compile_args = list(flags) + list(ext.extra_compile_args or [])
        super().build_extensions()


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
