"""Finds or builds llama.cpp's native C++ `llama-server` (and `llama-bench`, `llama-quantize`)
for the benchmarks.

    python benchmarks/llama_server.py                   # prints the path of llama-server
    python benchmarks/llama_server.py llama-quantize    # ... of llama-quantize

`find_or_build()` returns, in order: a `llama-server` on PATH; one already built in the
cache dir (~/.cache/xlaserve/llama-server/bin); else it builds one. `find_or_build_tool(name)`
does the same for any of the built tools (`llama-quantize` writes the K-quant GGUFs of
benchmarks/random_gguf.py: gguf-py has no K-quant quantizer). The build takes the
llama.cpp that llama-cpp-python vendors (`vendor/llama.cpp` of its sdist, fetched with
`pip download --no-binary :all:` from the configured package index), so it is the same
llama.cpp as the `llama_cpp.server` peer, and compiles only the `llama-server`,
`llama-bench` and `llama-quantize` targets with cmake (about 6-10 minutes on 2 cores,
under `nice -n 19`).

CPU flags: GGML_NATIVE is OFF on purpose. These VMs advertise AMX in /proc/cpuinfo but a
binary built with -march=native dies with "Illegal instruction", so the build names the
x86 extensions itself (AVX, AVX2, FMA, F16C, and the AVX-512 ones the CPU lists) and turns
AMX off. Static libraries (BUILD_SHARED_LIBS=OFF), so the binaries can be copied alone.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

# The newest llama-cpp-python the local package index offers (0.3.x vendors llama.cpp).
VERSION = "0.3.36"
DEFAULT_CACHE = "~/.cache/xlaserve/llama-server"
TARGETS = ("llama-server", "llama-bench", "llama-quantize")

# cmake option -> the /proc/cpuinfo flags it needs.
_X86_OPTIONS = {
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512f", "avx512vbmi"),
    "GGML_AVX512_VNNI": ("avx512f", "avx512_vnni"),
    "GGML_AVX512_BF16": ("avx512f", "avx512_bf16"),
}
_FIXED_OPTIONS = {
    "GGML_NATIVE": "OFF",  # -march=native: "Illegal instruction" on these VMs (AMX)
    "GGML_AMX_TILE": "OFF",
    "GGML_AMX_INT8": "OFF",
    "GGML_AMX_BF16": "OFF",
    "GGML_OPENMP": "ON",
    "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_CURL": "OFF",  # deprecated in newer llama.cpp (a warning only)
    "LLAMA_OPENSSL": "OFF",  # no HTTPS needed: the benchmark talks to 127.0.0.1
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "CMAKE_BUILD_TYPE": "Release",
}


def cpu_flags() -> set[str]:
  """The CPU feature flags of /proc/cpuinfo (empty off Linux)."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


def cmake_options(flags: set[str] | None = None) -> dict[str, str]:
  """The -D options of the build: fixed ones plus the x86 extensions the CPU has."""
  flags = cpu_flags() if flags is None else flags
  opts = dict(_FIXED_OPTIONS)
  for name, needs in _X86_OPTIONS.items():
    opts[name] = "ON" if all(n in flags for n in needs) else "OFF"
  return opts


def _works(path: str) -> bool:
  """True if `path` is an executable that runs here (not "Illegal instruction")."""
  if not (os.path.isfile(path) and os.access(path, os.X_OK)):
    return False
  try:
    proc = subprocess.run([path, "--version"], capture_output=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return proc.returncode == 0


def _nice() -> list[str]:
  return ["nice", "-n", "19"] if shutil.which("nice") else []


def _tool(name: str) -> str:
  """cmake / ninja: on PATH, next to this Python, or pip-installed into it."""
  found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
  if found:
    return found
  subprocess.run([sys.executable, "-m", "pip", "install", name], check=True, stdout=sys.stderr)
  found = shutil.which(name, path=os.path.dirname(sys.executable))
  if not found:
    raise RuntimeError(f"{name} not found after pip install {name}")
  return found


def _run(cmd: list[str], log, cwd: str | None = None) -> None:
  log("+ " + " ".join(cmd))
  subprocess.run(cmd, check=True, cwd=cwd, stdout=sys.stderr)  # stdout: only the path


def build(cache_dir: str = DEFAULT_CACHE, version: str = VERSION, jobs: int = 2,
          log=print) -> str:
  """Builds the TARGETS into `cache_dir`/bin -> the llama-server path."""
  cache_dir = os.path.expanduser(cache_dir)
  bin_dir = os.path.join(cache_dir, "bin")
  os.makedirs(cache_dir, exist_ok=True)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(dir=cache_dir, prefix="build-") as work:
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
          "--dest", work, f"llama-cpp-python=={version}"], log)
    (sdist,) = glob.glob(os.path.join(work, "llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
      tar.extractall(work, filter="data")
    (src,) = glob.glob(os.path.join(work, "llama_cpp_python-*", "vendor", "llama.cpp"))
    build_dir = os.path.join(work, "build")
    cmake = _tool("cmake")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}"]
    opts = [f"-D{k}={v}" for k, v in cmake_options().items()]
    _run([*_nice(), cmake, "-S", src, "-B", build_dir, *generator, *opts], log)
    _run([*_nice(), cmake, "--build", build_dir, f"-j{jobs}", "--target", *TARGETS], log)
    os.makedirs(bin_dir, exist_ok=True)
    for target in TARGETS:
      (built,) = glob.glob(os.path.join(build_dir, "bin", target))
      shutil.copy2(built, os.path.join(bin_dir, target))
    # Shared libraries the binaries need from the build tree (none with static libs).
    for lib in glob.glob(os.path.join(build_dir, "bin", "*.so*")):
      shutil.copy2(lib, bin_dir)
    with open(os.path.join(cache_dir, "BUILD_INFO"), "w", encoding="utf-8") as f:
      f.write(f"llama-cpp-python {version} (vendor/llama.cpp)\n")
      f.write(" ".join(opts) + "\n")
      f.write(f"build seconds: {time.perf_counter() - start:.0f}\n")
  path = os.path.join(bin_dir, "llama-server")
  if not _works(path):
    raise RuntimeError(f"{path} was built but does not run (`{path} --version` fails)")
  log(f"built {path} in {time.perf_counter() - start:.0f} s")
  return path


def find_or_build(cache_dir: str = DEFAULT_CACHE) -> str:
  """Path of a `llama-server`: on PATH, else built in `cache_dir`, else builds it there."""
  on_path = shutil.which("llama-server")
  if on_path:
    return on_path
  cached = os.path.join(os.path.expanduser(cache_dir), "bin", "llama-server")
  if _works(cached):
    return cached
  return build(cache_dir, log=lambda msg: print(msg, file=sys.stderr, flush=True))


def find_or_build_tool(name: str, cache_dir: str = DEFAULT_CACHE) -> str:
  """Path of the llama.cpp tool `name` (one of TARGETS): on PATH, else built in
  `cache_dir`, else builds all the TARGETS there (a cache from before a target was added
  lacks it: the build then runs again)."""
  if name not in TARGETS:
    raise ValueError(f"{name!r} is not built here; the targets are {TARGETS}")
  if name == "llama-server":
    return find_or_build(cache_dir)
  on_path = shutil.which(name)
  if on_path:
    return on_path
  cached = os.path.join(os.path.expanduser(cache_dir), "bin", name)
  if not (os.path.isfile(cached) and os.access(cached, os.X_OK)):
    build(cache_dir, log=lambda msg: print(msg, file=sys.stderr, flush=True))
  return cached


def bench_path(server_path: str) -> str | None:
  """The `llama-bench` next to a `llama-server` (or on PATH), if any."""
  sibling = os.path.join(os.path.dirname(server_path), "llama-bench")
  return sibling if os.path.isfile(sibling) else shutil.which("llama-bench")


if __name__ == "__main__":
  print(find_or_build_tool(sys.argv[1] if len(sys.argv) > 1 else "llama-server"))
