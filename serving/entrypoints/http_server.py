"""OpenAI-compatible HTTP server (FastAPI app + a uvicorn server without signal capture).

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions
(`stream: true` -> server-sent events ending in `data: [DONE]`), GET /health
(503 while draining), GET /metrics (Prometheus text), vLLM's POST /tokenize,
/detokenize and /reset_prefix_cache, and GET /debug/prefix_cache (the cached prefix
hashes as KV events name them, docs/kv_events.md). Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`.

A request's life: the body is read under a size limit and a time limit,
decoded as strict UTF-8 JSON and validated (`openai_protocol`); the CPU work
of preparing it (chat template, tokenization) runs in a worker thread, off
the event loop that every other request and /health share; `OpenAIServing`
admits its choices; a non-streaming request is raced against the client's
disconnect, a streaming one is cancelled by Starlette when the client goes;
either way leaving early aborts the engine requests and frees their pages.

With an API key, everything but /health and /metrics needs it, /openapi.json
included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.entrypoints.kv_connector import add_kv_routes
from serving.entrypoints.metrics import Metrics
from serving.entrypoints.openai_protocol import (
  APIError,
  ChatCompletionRequest,
  CompletionRequest,
  DetokenizeRequest,
  LoadLoraAdapterRequest,
  TokenizeRequest,
  UnloadLoraAdapterRequest,
  parse_json_object,
  validation_error,
)
from serving.entrypoints.openai_serving import OpenAIServing
from serving.entrypoints.startup import bind_error

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0


def build_app(serving: OpenAIServing, metrics: Metrics | None = None, *,
              api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
  """The FastAPI app serving `serving` (one engine, one model)."""
  app = FastAPI(title="xlaserve", docs_url=None, redoc_url=None, openapi_url=None)
  _install_error_handlers(app)
  _add_ops_routes(app, serving, metrics)
  authorize = _authorizer(api_key)
  if serving.kv is not None:
    add_kv_routes(app, serving.kv, authorize)

  @app.get("/openapi.json", include_in_schema=False)
  async def openapi(request: Request) -> Response:
    authorize(request)
    return JSONResponse(app.openapi())

  async def parse(request: Request, model: type[M]) -> M:
    return await _parse(request, model, max_body_bytes, body_timeout_s, serving.precheck)

  @app.get("/v1/models")
  async def models(request: Request) -> Response:
    authorize(request)
    return JSONResponse(serving.models())

  @app.get("/v1/models/{model_id:path}")
  async def model(model_id: str, request: Request) -> Response:
    authorize(request)
    serving.check_model(model_id)
    return JSONResponse(next(m for m in serving.models()["data"] if m["id"] == model_id))

  @app.post("/v1/completions")
  async def completions(request: Request) -> Response:
    authorize(request)
    req = await parse(request, CompletionRequest)
    job = await asyncio.to_thread(serving.prepare_completion, req)
    return await _respond(request, serving, job, req)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request) -> Response:
    authorize(request)
    req = await parse(request, ChatCompletionRequest)
    job = await asyncio.to_thread(serving.prepare_chat, req)
    return await _respond(request, serving, job, req)

  @app.post("/v1/load_lora_adapter")
  async def load_lora_adapter(request: Request) -> Response:
    authorize(request)
    req = await parse(request, LoadLoraAdapterRequest)
    return PlainTextResponse(await asyncio.to_thread(serving.load_lora_adapter, req))

  @app.post("/v1/unload_lora_adapter")
  async def unload_lora_adapter(request: Request) -> Response:
    authorize(request)
    req = await parse(request, UnloadLoraAdapterRequest)
    return PlainTextResponse(await asyncio.to_thread(serving.unload_lora_adapter, req))

  @app.post("/reset_prefix_cache")
  async def reset_prefix_cache(request: Request) -> Response:
    authorize(request)
    await asyncio.to_thread(serving.reset_prefix_cache)
    return Response(status_code=200)

  @app.get("/debug/prefix_cache")
  async def prefix_cache(request: Request) -> Response:
    authorize(request)
    return JSONResponse(await asyncio.to_thread(serving.prefix_cache))

  @app.post("/tokenize")
  async def tokenize(request: Request) -> Response:
    authorize(request)
    req = await parse(request, TokenizeRequest)
    return JSONResponse(await asyncio.to_thread(serving.tokenize, req))

  @app.post("/detokenize")
  async def detokenize(request: Request) -> Response:
    authorize(request)
    req = await parse(request, DetokenizeRequest)
    return JSONResponse(await asyncio.to_thread(serving.detokenize, req))

  return app


def _add_ops_routes(app: FastAPI, serving: OpenAIServing, metrics: Metrics | None) -> None:
  """/health and /metrics: unauthenticated, for probes and scrapers."""

  @app.get("/health")
  async def health() -> Response:
    if serving.engine.unavailable is not None:
      return JSONResponse({"status": "unavailable", "reason": serving.engine.unavailable},
                          status_code=503)
    if serving.engine.draining:
      return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})

  @app.get("/metrics")
  async def metrics_route() -> Response:
    if metrics is None:
      raise APIError(404, "metrics are disabled", code="not_found")
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
  """A check raising 401 unless the request carries `Authorization: Bearer <api_key>`."""

  def authorize(request: Request) -> None:
    if api_key is None:
      return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
      raise APIError(401, "Incorrect API key provided.", code="invalid_api_key",
                     headers={"WWW-Authenticate": "Bearer"})

  return authorize


def _install_error_handlers(app: FastAPI) -> None:
  @app.exception_handler(APIError)
  async def api_error(_: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
    err = APIError(exc.status_code, str(exc.detail), code=_code_for(exc.status_code))
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

  @app.exception_handler(RequestValidationError)
  async def request_validation(_: Request, exc: RequestValidationError) -> Response:
    err = APIError(400, str(exc.errors()[0].get("msg", exc)), code="invalid_value")
    return JSONResponse(err.body(), status_code=400)

  @app.exception_handler(Exception)
  async def internal(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    err = APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def _code_for(status: int) -> str | None:
  return {404: "not_found", 405: "method_not_allowed"}.get(status)


async def _parse(request: Request, model: type[M], max_body_bytes: int, body_timeout_s: float,
                 precheck: Callable[[dict[str, Any]], None]) -> M:
  """Reads, decodes and validates a JSON body into `model` (APIError on failure); the
  decoding runs in a worker thread (a 4 MiB body takes a fraction of a second)."""
  length = request.headers.get("content-length", "")
  if length.isdigit() and int(length) > max_body_bytes:
    raise APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
  try:
    body = await asyncio.wait_for(_read_body(request, max_body_bytes), body_timeout_s)
  except TimeoutError:
    raise APIError(408, f"the request body did not arrive within {body_timeout_s:g} s",
                   code="request_timeout") from None
  return await asyncio.to_thread(_decode, bytes(body), model, precheck)


def _decode(body: bytes, model: type[M], precheck: Callable[[dict[str, Any]], None]) -> M:
  try:
    text = body.decode("utf-8")
  except UnicodeDecodeError as e:
    raise APIError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}",
                   code="invalid_encoding") from None
  obj = parse_json_object(text)
  precheck(obj)  # list sizes, before the (costlier) model validation
  try:
    return model.model_validate(obj)
  except ValidationError as e:
    raise validation_error(e) from None


async def _read_body(request: Request, max_body_bytes: int) -> bytearray:
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > max_body_bytes:
      raise APIError(413, f"request body exceeds {max_body_bytes} bytes",
                     code="request_too_large")
  return body


async def _respond(request: Request, serving: OpenAIServing, job: Any,
                   req: CompletionRequest | ChatCompletionRequest) -> Response:
  try:
    if serving.kv is not None:  # a decode leg: its prefilled pages first
      await asyncio.to_thread(serving.pull_kv, job)
    return await _respond_to(request, serving, job, req)
  finally:
    serving.release_kv(job)  # cancelled or failed before it was submitted


async def _respond_to(request: Request, serving: OpenAIServing, job: Any,
                      req: CompletionRequest | ChatCompletionRequest) -> Response:
  if not req.stream:
    body = await _until_disconnect(request, serving.run(job))
    return JSONResponse(body)
  streams = serving.submit(job)
  chunks = serving.chunks(job, streams, req.include_usage(),
                          bool(req.stream_options and req.stream_options.continuous_usage_stats))
  return StreamingResponse(_sse(chunks), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
  try:
    async for chunk in chunks:
      yield b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"
  finally:
    await chunks.aclose()  # aborts unfinished choices when the client went away


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
  """Awaits `work`, cancelling it (and so aborting its requests) if the client goes."""
  task = asyncio.ensure_future(work)
  watcher = asyncio.ensure_future(_wait_disconnect(request))
  try:
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watcher.cancel()
    if not task.done():
      task.cancel()
  if not task.done() or task.cancelled():
    with contextlib.suppress(asyncio.CancelledError):
      await task
    raise APIError(499, "client closed the request", code="client_closed_request")
  return task.result()


async def _wait_disconnect(request: Request) -> None:
  while (await request.receive())["type"] != "http.disconnect":
    pass


class _H11WithHeaderTimeout(H11Protocol):
  """uvicorn's h11 protocol, closing a connection whose request line and headers do not
  all arrive within `header_timeout_s` (uvicorn has no such limit: a client sending a
  header byte a minute would hold its connection forever)."""

  header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
  _header_timer: asyncio.TimerHandle | None = None

  def connection_made(self, transport) -> None:  # type: ignore[override]
    super().connection_made(transport)
    self._arm()

  def data_received(self, data: bytes) -> None:
    if self._between_requests() and self._header_timer is None:
      self._arm()
    super().data_received(data)
    if not self._between_requests() and self._header_timer is not None:
      self._header_timer.cancel()
      self._header_timer = None

  def connection_lost(self, exc: Exception | None) -> None:
    if self._header_timer is not None:
      self._header_timer.cancel()
    super().connection_lost(exc)

  def _between_requests(self) -> bool:
    return self.cycle is None or self.cycle.response_complete

  def _arm(self) -> None:
    self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

  def _expire(self) -> None:
    self._header_timer = None
    if self._between_requests():
      self.transport.close()


class UvicornServer(uvicorn.Server):
  """uvicorn server that leaves signal handling to the launcher (graceful drain) and
  raises BindError where uvicorn would exit the process because it cannot bind."""

  @contextlib.contextmanager
  def capture_signals(self):
    yield

  async def startup(self, sockets: list | None = None) -> None:
    try:
      await super().startup(sockets=sockets)
    except SystemExit:  # uvicorn logged the OSError and calls sys.exit
      raise bind_error(f"HTTP port {self.config.port}", self.config.host, self.config.port,
                       "failed to bind") from None


def make_http_server(app: FastAPI, host: str, port: int, *, ssl_certfile: str | None = None,
                     ssl_keyfile: str | None = None, graceful_timeout_s: float = 30.0,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS,
                     keep_alive_timeout_s: float = 5.0,
                     header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> UvicornServer:
  """uvicorn over `app`: past `max_connections` open connections new requests get 503;
  an idle keep-alive connection is closed after `keep_alive_timeout_s`, one whose
  headers do not arrive after `header_timeout_s`; headers are bounded by h11's
  incomplete-event limit."""
  protocol = type("H11Protocol", (_H11WithHeaderTimeout,), {"header_timeout_s": header_timeout_s})
  config = uvicorn.Config(app, host=host, port=port, ssl_certfile=ssl_certfile,
                          ssl_keyfile=ssl_keyfile, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=graceful_timeout_s, lifespan="off",
                          limit_concurrency=max_connections,
                          timeout_keep_alive=keep_alive_timeout_s, http=protocol)
  return UvicornServer(config)
