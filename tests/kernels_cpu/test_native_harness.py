"""The native kernels' inner functions against scalar references, outside XLA
(tests/kernels_cpu/harness/kernels_harness.cc), on x86-64 and on aarch64.

There is no aarch64 jaxlib here, so the NEON set (kernels_cpu/quant_dot_neon.h,
attention_neon.h) is checked by cross-compiling the harness with Debian's
`aarch64-linux-gnu-g++` and running it under `qemu-aarch64` (its default CPU has SDOT,
so both the SDOT and the SMULL integer paths run); the same harness compiled natively
checks the AVX2 set and the AVX-512 VNNI integer tiles against the same references. The
integer tiles must equal the scalar model of quant_int.h's numerics bitwise, so every set
gives the same bits (on an aarch64 machine the native build checks NEON directly). The
library's aarch64 build (matvec.cc, attention.cc, decoder.cc against jaxlib's FFI
headers) is cross-compiled too, and its exported handlers are checked against the NEON
targets kernels_cpu/library.py registers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels_cpu import library

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels_cpu"
HARNESS = Path(__file__).resolve().parent / "harness" / "kernels_harness.cc"
CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"
FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-Wno-attributes", f"-I{KERNELS}"]

needs_cross = pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None or not os.path.isdir(SYSROOT),
    reason=f"needs the aarch64 cross toolchain and qemu-user ({CROSS}, {QEMU}, {SYSROOT}: "
           "apt-get install g++-aarch64-linux-gnu qemu-user)")


def _run(cmd: list[str], timeout: int) -> str:
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
  assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
  return done.stdout


def _check_report(out: str, expected: list[str]) -> None:
  assert out.strip().endswith("ok"), out
  for line in expected:
    assert line in out, f"{line!r} not in the harness's report:\n{out}"


NEON_REPORT = ["integer tiles neon: 60 cases bitwise equal",
               "integer tiles neon+sdot: 60 cases bitwise equal",
               "float tiles neon u8: 15 cases", "float tiles neon q8_0: 15 cases",
               "float tiles neon q4_1: 15 cases", "float tiles neon q4_0: 15 cases",
               "attention neon kind 0: 56 cases", "attention neon kind 1: 56 cases",
               "attention neon kind 2: 56 cases", "exp neon: 1880 values"]
# machine -> what the natively compiled harness must report
NATIVE_REPORT = {
    "x86_64": ["integer tiles avx2: 60 cases bitwise equal", "float tiles avx2 q4_1: 15 cases",
               "attention avx2 kind 2: 56 cases", "exp avx2: 1880 values"],
    "aarch64": [line for line in NEON_REPORT if "sdot" not in line],  # SDOT: if the CPU has it
}


@pytest.mark.slow  # on x86-64 the AVX2 set's bits: also test_int_exact.py (fast tier), via XLA
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine not in NATIVE_REPORT
                    or shutil.which("g++") is None, reason="needs g++ on x86-64 or aarch64 Linux")
def test_harness_native(tmp_path):
  """This machine's sets against the references: AVX2 (and, where the CPU has it, the
  AVX-512 VNNI integer tiles) on x86-64, NEON on aarch64."""
  exe = tmp_path / "harness"
  _run(["g++", *FLAGS, str(HARNESS), "-o", str(exe)], timeout=300)
  _check_report(_run([str(exe)], timeout=120), NATIVE_REPORT[os.uname().machine])


@needs_cross
def test_harness_neon_under_qemu(tmp_path):
  """NEON float and integer tiles (SDOT and SMULL) and attention against the references."""
  exe = tmp_path / "harness"
  _run([CROSS, *FLAGS, str(HARNESS), "-o", str(exe)], timeout=300)
  _check_report(_run([QEMU, "-L", SYSROOT, str(exe)], timeout=300), NEON_REPORT)


def _ffi_include() -> Path:
  import jaxlib  # noqa: PLC0415

  return Path(jaxlib.__file__).parent / "include"


@pytest.mark.slow  # ~20 s: three sources against jaxlib's FFI headers
@needs_cross
def test_library_builds_for_aarch64_with_the_neon_targets(tmp_path):
  """setup.py's sources compile and link for aarch64, and the library exports the CPU check
  and every handler of library.SETS["neon"] (and no x86 set: those take no part there)."""
  objects = []
  for source in ("matvec.cc", "attention.cc", "decoder.cc"):
    obj = tmp_path / (source + ".o")
    _run([CROSS, "-O1", "-std=c++17", "-fPIC", "-Wno-attributes", "-Wno-return-type",
          f"-I{_ffi_include()}", f"-I{KERNELS}", "-c", str(KERNELS / source), "-o", str(obj)],
         timeout=600)
    objects.append(str(obj))
  lib = tmp_path / "_native.so"
  _run([CROSS, "-shared", "-o", str(lib), *objects], timeout=120)
  nm = shutil.which("aarch64-linux-gnu-nm") or "nm"
  exported = {line.split()[-1] for line in _run([nm, "-D", "--defined-only", str(lib)],
                                                timeout=60).splitlines() if line.strip()}
  check, targets = library.SETS["neon"]
  assert check in exported
  assert "xlaserve_matvec_max_rows" in exported
  missing = sorted(set(targets.values()) - exported)
  assert not missing, f"handlers library.py registers but the aarch64 build lacks: {missing}"
  for x86_set in ("avx512", "avx2"):
    assert library.SETS[x86_set][0] not in exported


@pytest.mark.skipif(os.uname().machine != "x86_64" or library.library_path() is None,
                    reason="needs the library built on x86-64")
def test_x86_library_has_no_neon_set():
  """An x86-64 build exports no NEON check, so `neon` is never usable (nor forced) there."""
  assert "neon" not in library.usable_isas()
  assert library.usable_isas() <= {"avx512", "avx2"}
