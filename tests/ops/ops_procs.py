"""The real server as a subprocess for the operations tests, plus probes of its state.

`OpsServer` runs `python -m serving.launcher serve` on free loopback ports
with the default model and the small engine config shared with the other
default-model tests (so the persistent compilation cache is shared too),
waits for the ready line and stops it with SIGTERM. `idle_state()` reads the
server's `/metrics` (running, waiting, KV usage) and `rss_bytes()` its
resident memory from /proc.
"""

from __future__ import annotations

import os
import time

import server_procs
from server_procs import DEFAULT_MODEL as MODEL
from server_procs import REPO, engine_flags, metrics, require_real_model  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
START_TIMEOUT_S = 600  # load + warm-up; minutes on a 2-core machine shared with other jobs


class OpsServer(server_procs.ServerProcess):
  """`xlaserve serve` with the default model on free loopback ports (ops_faults importable)."""

  def __init__(self, *flags: str, scheme: str = "http", engine: str | None = None):
    require_real_model()
    super().__init__(f"--model={MODEL}", *engine_flags(), *flags,
                     env=server_procs.subprocess_env(HERE), start_timeout_s=START_TIMEOUT_S,
                     scheme=scheme, engine=engine)

  def terminate(self, timeout_s: float = 120) -> int:
    return super().terminate(timeout_s)


def rss_bytes(pid: int) -> int:
  """Resident set size of a process, from /proc/<pid>/status."""
  with open(f"/proc/{pid}/status", encoding="ascii") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f"no VmRSS for pid {pid}")


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


def assert_pages_free(srv: OpsServer) -> None:
  """Once idle, a live server has nothing running or waiting and every KV page free."""
  if srv.proc.poll() is None:
    state = wait_idle(srv.http, timeout_s=60)
    assert state == (0.0, 0.0, 0.0), f"(running, waiting, kv usage) after the test: {state}"
