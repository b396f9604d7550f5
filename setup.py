"""Builds the optional native parts from csrc/ when it can.

* ``ec_nixl._C`` (torch extension): the one-launch pack kernel;
* ``ec_nixl._handoff`` (no Python API, loaded with ctypes; any C++ compiler, no NIXL header): the native
  hand-off thread (ec_nixl/handoff.py).

Everything works without them (Python fallbacks); set EC_NIXL_NO_EXT=1 to skip both, or
EC_NIXL_REQUIRE_EXT=1 to make a failed build an error. Package metadata lives in pyproject.toml.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def handoff_library():
    """The hand-off library: C++ and pthreads, no Python API: loaded by ctypes (it has no Python module init)."""
    src = os.path.join("csrc", "handoff.cpp")
    if not os.path.exists(os.path.join(HERE, src)):
        return []
    return [Extension("ec_nixl._handoff", [src], libraries=["pthread"], extra_compile_args=["-O2"])]


def native_extensions():
    if os.environ.get("EC_NIXL_NO_EXT") == "1":
        return [], {}
    plain = handoff_library()
    src = os.path.join("csrc", "ec_nixl_C.cpp")
    if not os.path.exists(os.path.join(HERE, src)):
        return plain, {"build_ext": _Optional.wrap(build_ext)}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
    except Exception as e:  # no torch at build time: fall back to pure Python
        print(f"ec-nixl: not building the torch extension ({e})", file=sys.stderr)
        return plain, {"build_ext": _Optional.wrap(build_ext)}
    sources = [src]
    # Which torch the extension is built against, in the binary and beside it: ec_nixl.native uses
    # it only under that same torch (a venv with another torch importing this checkout's build,
    # e.g. scripts/test.sh's official-vLLM venvs, would otherwise run it against another ABI).
    built_for = [("EC_NIXL_TORCH_VERSION", f'"{torch.__version__}"')]
    with open(os.path.join(HERE, "ec_nixl", "_C.torch"), "w") as f:
        f.write(torch.__version__ + "\n")
    cu = os.path.join("csrc", "pack.cu")
    # The CUDA build needs nvcc and a CUDA torch; a CPU torch gets the CPU-only extension (pack).
    use_cuda = CUDA_HOME is not None and torch.version.cuda is not None and \
        os.path.exists(os.path.join(HERE, cu)) and os.environ.get("EC_NIXL_NO_CUDA_EXT") != "1"
    if use_cuda:
        ext = CUDAExtension("ec_nixl._C", sources + [cu], define_macros=[("EC_NIXL_WITH_CUDA", "1")] + built_for,
                            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-gencode=arch=compute_90,code=sm_90",
                                                                          "-gencode=arch=compute_80,code=sm_80"]})
    else:
        ext = CppExtension("ec_nixl._C", sources, define_macros=built_for, extra_compile_args=["-O3"])
    return [ext] + plain, {"build_ext": _Optional.wrap(BuildExtension)}


class _Optional:
    @staticmethod
    def wrap(base):
        class OptionalBuild(base):
            def run(self):
                try:
                    super().run()
                except Exception as e:
                    if os.environ.get("EC_NIXL_REQUIRE_EXT") == "1":
                        raise
                    print(f"ec-nixl: native extension not built ({e}); using Python fallbacks", file=sys.stderr)

            def build_extension(self, ext):
                try:
                    super().build_extension(ext)
                except Exception as e:
                    if os.environ.get("EC_NIXL_REQUIRE_EXT") == "1":
                        raise
                    print(f"ec-nixl: {ext.name} not built ({e}); using Python fallbacks", file=sys.stderr)

        return OptionalBuild


ext_modules, cmdclass = native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
