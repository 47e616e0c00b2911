"""One serving process: an engine behind the HTTP and gRPC front ends.

Lifecycle (`serve()`):
  1. The engine's step loop starts; an `AsyncEngine`, the per-server
     `Metrics` registry and `OpenAIServing` are built around it.
  2. gRPC binds and starts, then uvicorn; `ready(http_port, grpc_port)` is
     called once both accept connections.
  3. `serve()` waits for `stop` (the launcher sets it on SIGTERM / SIGINT),
     while a watchdog polls `engine.health()`.
  4. Drain: new requests are refused (HTTP 503, gRPC UNAVAILABLE, health
     NOT_SERVING), listeners close, in-flight requests get `drain_timeout_s`
     to finish; whatever is left is aborted. The engine shuts down last.
If the engine dies or wedges, the watchdog ends every in-flight request with
an error, turns health to 503 / NOT_SERVING, refuses new requests with 503 /
UNAVAILABLE and stops the server; `serve()` then raises `EngineDeadError`, so
the process exits non-zero and an orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from serving.engine import EngineClient, EngineDeadError
from serving.entrypoints.async_engine import AsyncEngine
from serving.entrypoints.grpc_server import GrpcServer
from serving.entrypoints.http_server import (
  DEFAULT_BODY_TIMEOUT_S,
  DEFAULT_HEADER_TIMEOUT_S,
  DEFAULT_MAX_BODY_BYTES,
  DEFAULT_MAX_CONNECTIONS,
  build_app,
  make_http_server,
)
from serving.entrypoints.kv_connector import KVConnector
from serving.entrypoints.limits import RequestLimits
from serving.entrypoints.metrics import Metrics
from serving.entrypoints.openai_serving import OpenAIServing

log = logging.getLogger(__name__)
# After the drain deadline, aborted streams still get this long to send their last chunk.
_FLUSH_S = 5.0


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Front-end options (the launcher's `serve` flags)."""

  served_model_name: str
  host: str = "127.0.0.1"
  http_port: int = 8000  # 0 picks a free port; < 0 disables HTTP
  grpc_port: int = 9000  # 0 picks a free port; < 0 disables gRPC
  api_key: str | None = None
  tls_cert: str | None = None
  tls_key: str | None = None
  max_queued_requests: int | None = 256
  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
  body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a request body arriving slower: 408
  header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # request headers slower: closed
  max_connections: int = DEFAULT_MAX_CONNECTIONS  # HTTP connections; gRPC concurrent calls
  drain_timeout_s: float = 30.0
  # Once the engine cannot serve, how long health (503 / NOT_SERVING) and new requests
  # (503 / UNAVAILABLE) say so before the process exits: probes and load balancers see it.
  unhealthy_exit_delay_s: float = 2.0
  allow_runtime_lora: bool = False  # serve the load / unload LoRA adapter endpoints
  # Prefill / decode across servers (the engine's kv_role; serving/entrypoints/kv_connector.py):
  # how long pinned pages wait for a pull, and each transfer step waits for the other side.
  kv_transfer_timeout_s: float = 30.0
  limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

  def __post_init__(self):
    if bool(self.tls_cert) != bool(self.tls_key):
      raise ValueError("tls_cert and tls_key must be given together")
    if self.max_queued_requests is not None and self.max_queued_requests < 0:
      raise ValueError(f"max_queued_requests={self.max_queued_requests} must be >= 0")
    if self.http_port < 0 and self.grpc_port < 0:
      raise ValueError("at least one of http_port and grpc_port must be enabled")
    if self.max_connections < 1 or not self.body_timeout_s > 0 or not self.header_timeout_s > 0:
      raise ValueError("max_connections, body_timeout_s and header_timeout_s must be positive")
    if not self.kv_transfer_timeout_s > 0:
      raise ValueError(f"kv_transfer_timeout_s={self.kv_transfer_timeout_s} must be positive")


async def serve(engine: EngineClient, cfg: ServeConfig, stop: asyncio.Event,
                ready: Callable[[int | None, int | None], None] | None = None) -> None:
  """Serves `engine` over HTTP and gRPC until `stop` is set, then drains."""
  engine.start()
  metrics = Metrics.for_engine(engine, model_name=cfg.served_model_name)
  aengine = AsyncEngine(engine, metrics=metrics, max_queued_requests=cfg.max_queued_requests)
  names = list(dict.fromkeys([cfg.served_model_name, engine.model_name]))
  kv = _kv_connector(engine, cfg)
  serving = OpenAIServing(aengine, [n for n in names if n], cfg.limits,
                          allow_runtime_lora=cfg.allow_runtime_lora, kv=kv)
  grpc_server = http_server = http_task = watchdog = expiry = None
  http_port = grpc_port = None
  try:
    if cfg.grpc_port >= 0:
      grpc_server = GrpcServer(serving, cfg.served_model_name, api_key=cfg.api_key,
                               max_message_bytes=cfg.max_body_bytes,
                               max_concurrent_rpcs=cfg.max_connections)
      grpc_port = grpc_server.bind(cfg.host, cfg.grpc_port, tls_cert=cfg.tls_cert,
                                   tls_key=cfg.tls_key)
      await grpc_server.start()
    if cfg.http_port >= 0:
      app = build_app(serving, metrics, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes,
                      body_timeout_s=cfg.body_timeout_s)
      http_server = make_http_server(app, cfg.host, cfg.http_port, ssl_certfile=cfg.tls_cert,
                                     ssl_keyfile=cfg.tls_key,
                                     graceful_timeout_s=cfg.drain_timeout_s + _FLUSH_S,
                                     max_connections=cfg.max_connections,
                                     header_timeout_s=cfg.header_timeout_s)
      http_task = asyncio.create_task(http_server.serve())
      http_port = await _wait_started(http_server, http_task)
      if kv is not None:
        kv.bind(http_port)
        expiry = asyncio.create_task(kv.expire_loop())
    if ready is not None:  # the caller reports readiness (the launcher's ready line)
      ready(http_port, grpc_port)
    else:
      log.info("serving %s: http port %s, grpc port %s", cfg.served_model_name, http_port,
               grpc_port)
    watchdog = asyncio.create_task(_watch(engine, aengine, grpc_server, stop,
                                          cfg.unhealthy_exit_delay_s))
    await stop.wait()
    log.info("draining (up to %.0f s)", cfg.drain_timeout_s)
  finally:
    for task in (watchdog, expiry):
      if task is not None:
        task.cancel()
    await _drain(aengine, grpc_server, http_server, http_task, cfg.drain_timeout_s)
    engine.shutdown(timeout_s=10.0 if aengine.unavailable is None else 1.0)
  if aengine.unavailable is not None:
    raise EngineDeadError(aengine.unavailable)


def _kv_connector(engine: EngineClient, cfg: ServeConfig) -> KVConnector | None:
  """This server's end of prefill / decode across servers (its engine's kv_role)."""
  role = engine.config.parallel.kv_role
  if role == "both":
    return None
  if cfg.http_port < 0:
    raise ValueError(f"kv_role={role!r} needs HTTP (the kv_transfer_params contract)")
  return KVConnector(engine, role, timeout_s=cfg.kv_transfer_timeout_s, host=cfg.host,
                     api_key=cfg.api_key)


async def _watch(engine: EngineClient, aengine: AsyncEngine, grpc_server: GrpcServer | None,
                 stop: asyncio.Event, exit_delay_s: float) -> None:
  """Polls `engine.health()`; on the first failure, fails everything, reports unhealthy
  for `exit_delay_s`, then stops the server."""
  interval = min(0.5, engine.config.scheduler.step_timeout_s / 4)
  while (reason := engine.health()) is None:
    await asyncio.sleep(interval)
  log.error("the engine cannot serve: %s", reason)
  aengine.fail_all(reason)
  if grpc_server is not None:
    await grpc_server.set_serving(False)
  await asyncio.sleep(exit_delay_s)
  stop.set()


async def _wait_started(server: Any, task: asyncio.Task) -> int:
  while not server.started:
    if task.done():
      task.result()  # re-raises the bind error
      raise OSError("HTTP server exited during start-up")
    await asyncio.sleep(0.02)
  return server.servers[0].sockets[0].getsockname()[1]


async def _drain(aengine: AsyncEngine, grpc_server: GrpcServer | None, http_server: Any,
                 http_task: asyncio.Task | None, timeout_s: float) -> None:
  aengine.stop_accepting()
  if http_server is not None:
    http_server.should_exit = True
  grpc_stop = grpc_server.stop(timeout_s) if grpc_server is not None else asyncio.sleep(0)
  _, idle = await asyncio.gather(grpc_stop, aengine.wait_idle(timeout_s))
  if not idle:
    log.warning("drain deadline passed; aborting %d requests", aengine.num_inflight)
    aengine.abort_all()
  if http_task is not None:
    try:
      await asyncio.wait_for(http_task, timeout_s + 2 * _FLUSH_S)
    except TimeoutError:
      log.warning("HTTP server did not stop in time")
