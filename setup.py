"""Builds the native CPU kernels (kernels_cpu/*.cc) during `pip install`.

Everything else is declared in pyproject.toml. The kernels are an XLA FFI
library compiled against jaxlib's FFI headers (a build requirement) with
per-function target attributes, so it loads on any x86-64 CPU and checks the
instructions it needs at run time. On aarch64 the same sources build the NEON
set (Advanced SIMD, the aarch64 baseline; SDOT chosen at run time). The
extension is optional: where it does not compile (no C++17 compiler, another
architecture) the install still succeeds and the engine uses the XLA path
(kernels_cpu.available() is False).
"""

import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include_dir() -> str:
  import importlib.util  # noqa: PLC0415

  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError("jaxlib (for the XLA FFI headers) is not installed")
  return os.path.join(spec.submodule_search_locations[0], "include")


class BuildNative(build_ext):
  """build_ext that finds the FFI headers and skips what cannot be built."""

  def build_extensions(self):
    try:
      include = _ffi_include_dir()
    except RuntimeError as e:
      print(f"xlaserve: native CPU kernels not built ({e}); the XLA path will be used")
      self.extensions = []
      return
    for ext in self.extensions:
      ext.include_dirs.append(include)
    super().build_extensions()

  def get_ext_filename(self, fullname):
    # A plain shared library loaded with ctypes, not a Python module: no ABI tag.
    return os.path.join(*fullname.split(".")) + ".so"


SOURCES = ["kernels_cpu/matvec.cc", "kernels_cpu/attention.cc", "kernels_cpu/decoder.cc"]
COMMON_HEADERS = ["kernels_cpu/parallel.h", "kernels_cpu/quant_format.h",
                  "kernels_cpu/attention_pages.h"]
# machine -> the headers of its instruction sets (the sources pick them with #if).
HEADERS = {
    "x86_64": ["kernels_cpu/quant_dot.h", "kernels_cpu/quant_gemm.h", "kernels_cpu/quant_int.h",
               "kernels_cpu/kquant_dot.h", "kernels_cpu/attention.h",
               "kernels_cpu/quant_dot_avx2.h", "kernels_cpu/attention_avx2.h"],
    "aarch64": ["kernels_cpu/quant_dot_neon.h", "kernels_cpu/attention_neon.h"],
}
MACHINE = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(),
                                                      platform.machine().lower())

NATIVE = []
if MACHINE in HEADERS:
  NATIVE.append(Extension(
      "kernels_cpu._native", sources=SOURCES, depends=COMMON_HEADERS + HEADERS[MACHINE],
      language="c++",
      extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes",
                          "-Wno-return-type"],
      optional=True))

setup(ext_modules=NATIVE, cmdclass={"build_ext": BuildNative})
