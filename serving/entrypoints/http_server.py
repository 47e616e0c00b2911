"""OpenAI-compatible HTTP server (FastAPI app + a uvicorn server without signal capture).

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions
(`stream: true` -> server-sent events ending in `data: [DONE]`), GET /health
(503 while draining), GET /metrics (Prometheus text), and vLLM's POST /tokenize
and /detokenize. Every error is an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`.

A request's life: the body is read under a size limit, decoded as strict
UTF-8 JSON and validated (`serving.openai_protocol`); `OpenAIServing` admits
its choices; a non-streaming request is raced against the client's
disconnect, a streaming one is cancelled by Starlette when the client goes;
either way leaving early aborts the engine requests and frees their pages.
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.entrypoints.metrics import Metrics
from serving.entrypoints.openai_protocol import (
  APIError,
  ChatCompletionRequest,
  CompletionRequest,
  DetokenizeRequest,
  TokenizeRequest,
  validation_error,
)
from serving.entrypoints.openai_serving import OpenAIServing

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def build_app(serving: OpenAIServing, metrics: Metrics | None = None, *,
              api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
  """The FastAPI app serving `serving` (one engine, one model)."""
  app = FastAPI(title="xlaserve", docs_url=None, redoc_url=None)
  _install_error_handlers(app)
  _add_ops_routes(app, serving, metrics)
  authorize = _authorizer(api_key)

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
    req = await _parse(request, CompletionRequest, max_body_bytes)
    job = serving.prepare_completion(req)
    return await _respond(request, serving, job, req)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request) -> Response:
    authorize(request)
    req = await _parse(request, ChatCompletionRequest, max_body_bytes)
    job = serving.prepare_chat(req)
    return await _respond(request, serving, job, req)

  @app.post("/tokenize")
  async def tokenize(request: Request) -> Response:
    authorize(request)
    return JSONResponse(serving.tokenize(await _parse(request, TokenizeRequest, max_body_bytes)))

  @app.post("/detokenize")
  async def detokenize(request: Request) -> Response:
    authorize(request)
    req = await _parse(request, DetokenizeRequest, max_body_bytes)
    return JSONResponse(serving.detokenize(req))

  return app


def _add_ops_routes(app: FastAPI, serving: OpenAIServing, metrics: Metrics | None) -> None:
  """/health and /metrics: unauthenticated, for probes and scrapers."""

  @app.get("/health")
  async def health() -> Response:
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


async def _parse(request: Request, model: type[M], max_body_bytes: int) -> M:
  """Reads, decodes and validates a JSON body into `model` (APIError on failure)."""
  length = request.headers.get("content-length", "")
  if length.isdigit() and int(length) > max_body_bytes:
    raise APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > max_body_bytes:
      raise APIError(413, f"request body exceeds {max_body_bytes} bytes",
                     code="request_too_large")
  try:
    text = bytes(body).decode("utf-8")
  except UnicodeDecodeError as e:
    raise APIError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}",
                   code="invalid_encoding") from None
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
  if not isinstance(obj, dict):
    raise APIError(400, "request body must be a JSON object", code="invalid_json")
  try:
    return model.model_validate(obj)
  except ValidationError as e:
    raise validation_error(e) from None


async def _respond(request: Request, serving: OpenAIServing, job: Any,
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


class UvicornServer(uvicorn.Server):
  """uvicorn server that leaves signal handling to the launcher (graceful drain)."""

  @contextlib.contextmanager
  def capture_signals(self):
    yield


def make_http_server(app: FastAPI, host: str, port: int, *, ssl_certfile: str | None = None,
                     ssl_keyfile: str | None = None,
                     graceful_timeout_s: float = 30.0) -> UvicornServer:
  config = uvicorn.Config(app, host=host, port=port, ssl_certfile=ssl_certfile,
                          ssl_keyfile=ssl_keyfile, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=graceful_timeout_s, lifespan="off")
  return UvicornServer(config)
