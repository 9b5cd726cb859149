"""Builds weightstream's native CPU kernels (csrc/) as a torch C++ extension, when torch and a compiler are there.

pyproject.toml holds the package's metadata; this file only adds the extension. It needs the torch it will run
with at build time, so install with `pip install --no-build-isolation` after torch (the Makefile does). Without
torch, or when the compiler fails, the package installs without the extension and weightstream runs torch's own
kernels, saying so once (`weightstream.native`).
"""

import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print("weightstream: torch is not importable while building, so the native kernels are not built", file=sys.stderr)
else:

    class OptionalBuild(BuildExtension):
        """A failed compile leaves the package without its native kernels instead of failing the install."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # no compiler, an unsupported one: torch's kernels run instead
                print(f"weightstream: native kernels not built ({type(exc).__name__}: {exc})", file=sys.stderr)

    ext_modules = [
        CppExtension(
            "weightstream._native",
            ["csrc/qmm.cpp", "csrc/layers.cpp", "csrc/latent.cpp", "csrc/decode.cpp"],
            depends=["csrc/tiles.inc"],  # included by qmm.cpp (twice: once per instruction set)
            # -ffp-contract=off: the compiler fuses no multiply-add on its own, so every path rounds the same way;
            # -fopenmp: at::parallel_for is a header template that runs on torch's OpenMP pool only when the
            # extension itself is compiled with OpenMP (without it, every product runs on one thread)
            extra_compile_args=["-O3", "-ffp-contract=off", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": OptionalBuild.with_options(use_ninja=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
