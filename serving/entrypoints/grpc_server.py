"""gRPC front end (`grpc.aio`): the `xlaserve.v1.Generation` service, health, reflection.

A Generate call's life:
  1. The prompt (text, token ids or chat messages) is tokenized and checked
     like an HTTP request (`OpenAIServing`); bad input -> INVALID_ARGUMENT.
  2. The request is admitted through `AsyncEngine.submit` (queue full ->
     RESOURCE_EXHAUSTED with trailing `retry-after`, draining -> UNAVAILABLE).
  3. Each engine delta becomes one `GenerateResponse` (new token ids, text,
     logprobs); the last carries `finish_reason` and `usage`.
  4. Client cancellation or a passed deadline cancels the handler task; the
     `finally` aborts the engine request, freeing its KV pages before the
     engine's next step.
The optional API key is checked by an interceptor (`authorization: Bearer
<key>` metadata, constant-time compare); only health stays open (reflection
needs the key too). A client's `request_id` is a label echoed in responses;
the engine request gets a server-made unique id, so ids from different
clients never collide and a cancelled id can be reused at once.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from serving.entrypoints.async_engine import (
  AsyncEngine,
  EngineUnavailableError,
  ServerBusyError,
  ServerDrainingError,
)
from serving.entrypoints.openai_protocol import (
  APIError,
  DetokenizeRequest,
  LoadLoraAdapterRequest,
  UnloadLoraAdapterRequest,
  validation_error,
)
from serving.entrypoints.openai_serving import OpenAIServing, admission_error
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc
from serving.entrypoints.startup import bind_error
from serving.types import RequestOutput, SamplingParams

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
           408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
           429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
# Connection hygiene: ping idle clients, drop dead ones, refuse ping floods.
_KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000),
                      ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                      ("grpc.http2.max_ping_strikes", 2),
                      ("grpc.max_connection_idle_ms", 600_000)]


class GenerationServicer(pb_grpc.GenerationServicer):
  """Implements `xlaserve.v1.Generation` over an `AsyncEngine`."""

  def __init__(self, serving: OpenAIServing, model_name: str):
    self.serving = serving
    self.engine: AsyncEngine = serving.engine
    self.model_name = model_name

  async def Generate(self, request: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
    try:
      label = self._request_label(request.request_id)
      lora = self.serving.check_model(request.lora) if request.lora else None
      ids, params = await asyncio.to_thread(self._prepare, request)
      stream = self.engine.submit(ids, params, lora=lora)
    except APIError as e:
      await _abort(context, e)
    except (ServerBusyError, ServerDrainingError, EngineUnavailableError, ValueError) as e:
      await _abort(context, admission_error(e))
    num_tokens = 0
    try:
      async for out in stream:
        if out.finish_reason == "error":
          await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {out.error}")
        num_tokens += len(out.token_ids)
        first = num_tokens == len(out.token_ids)
        yield _response(label or stream.request_id, out, num_tokens,
                        with_prompt=first and request.return_prompt_token_ids)
    finally:
      stream.abort()  # no-op when finished; frees the pages when cancelled

  def _request_label(self, request_id: str) -> str:
    limit = self.serving.limits.max_request_id_chars
    if len(request_id) > limit:
      raise APIError(400, f"request_id has {len(request_id)} characters; the limit is {limit}")
    return request_id

  def _prepare(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams]:
    """Tokenized prompt and checked sampling parameters (a worker thread's job)."""
    ids = self._prompt_ids(request)
    return ids, self.serving.checked(self._sampling_params(request.sampling, ids))

  async def Tokenize(self, request: pb.TokenizeRequest,
                     context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
    if len(request.text) > self.serving.limits.max_input_chars:
      await _abort(context, APIError(400, f"text has {len(request.text)} characters; the "
                                     f"limit is {self.serving.limits.max_input_chars}"))
    ids = await asyncio.to_thread(self.serving.tokenizer.encode, request.text,
                                  add_special_tokens=request.add_special_tokens)
    return pb.TokenizeResponse(token_ids=ids, count=len(ids))

  async def Detokenize(self, request: pb.DetokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
    try:
      resp = await asyncio.to_thread(self.serving.detokenize,
                                     DetokenizeRequest(tokens=list(request.token_ids)))
    except APIError as e:
      await _abort(context, e)
    return pb.DetokenizeResponse(text=resp["prompt"])

  async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                         context: grpc.aio.ServicerContext) -> pb.ModelInfo:
    adapters = [pb.LoraAdapter(name=a.name, path=a.path)
                for a in self.engine.engine.list_loras()]
    return pb.ModelInfo(model=self.model_name, max_model_len=self.engine.max_model_len,
                        vocab_size=self.serving.tokenizer.vocab_size,
                        max_num_seqs=self.engine.engine.config.scheduler.max_num_seqs,
                        lora_adapters=adapters)

  async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                            context: grpc.aio.ServicerContext) -> pb.LoraAdapterResponse:
    try:
      req = _validated(LoadLoraAdapterRequest, lora_name=request.lora_name,
                       lora_path=request.lora_path)
      message = await asyncio.to_thread(self.serving.load_lora_adapter, req)
    except APIError as e:
      await _abort(context, e)
    return pb.LoraAdapterResponse(message=message)

  async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoraAdapterResponse:
    try:
      req = _validated(UnloadLoraAdapterRequest, lora_name=request.lora_name)
      message = self.serving.unload_lora_adapter(req)
    except APIError as e:
      await _abort(context, e)
    return pb.LoraAdapterResponse(message=message)

  def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "text":
      return self.serving.tokenize_prompt(request.text, add_special_tokens=True)
    if kind == "token_ids":
      return self.serving.tokenize_prompt(list(request.token_ids.ids), add_special_tokens=False)
    if kind == "chat":
      chat = request.chat
      messages = [{"role": m.role, "content": m.content} for m in chat.messages]
      if not messages:
        raise APIError(400, "chat.messages must not be empty")
      gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
      return self.serving.tokenize_prompt(self.serving.render_chat(messages, gen),
                                          add_special_tokens=False)
    raise APIError(400, "one of text, token_ids or chat must be set")

  def _sampling_params(self, s: pb.SamplingParams, ids: list[int]) -> SamplingParams:
    requested = s.max_tokens if s.HasField("max_tokens") else None
    if requested == 0:
      raise APIError(400, "max_tokens must be at least 1")
    opt = lambda name, default: getattr(s, name) if s.HasField(name) else default
    try:
      params = SamplingParams(
          max_tokens=self.serving.resolve_max_tokens(ids, requested, None),
          temperature=opt("temperature", 1.0), top_p=opt("top_p", 1.0), top_k=opt("top_k", -1),
          min_p=opt("min_p", 0.0), repetition_penalty=opt("repetition_penalty", 1.0),
          presence_penalty=opt("presence_penalty", 0.0),
          frequency_penalty=opt("frequency_penalty", 0.0), seed=opt("seed", None),
          stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
          logprobs=opt("logprobs", None), include_stop_str_in_output=s.include_stop_str_in_output,
          skip_special_tokens=opt("skip_special_tokens", True),
          structured_outputs=_structured_outputs(s))
    except ValueError as e:
      raise APIError(400, str(e)) from None
    try:  # compiled here, in the worker thread; the engine finds it cached
      self.engine.engine.check_structured_outputs(params)
    except ValueError as e:
      raise APIError(400, str(e)) from None
    return params


def _structured_outputs(s: pb.SamplingParams) -> dict | None:
  """The proto's structured_outputs as SamplingParams' dict form (None when unset)."""
  if not s.HasField("structured_outputs"):
    return None
  so = s.structured_outputs
  kind = so.WhichOneof("constraint")
  if kind is None:
    raise ValueError("structured_outputs must set one of json, regex, choice, grammar, "
                     "json_object")
  value = getattr(so, kind)
  return {kind: list(value.choices) if kind == "choice" else value}


def _response(request_id: str, out: RequestOutput, num_tokens: int,
              with_prompt: bool) -> pb.GenerateResponse:
  resp = pb.GenerateResponse(request_id=request_id, token_ids=out.token_ids, text=out.text)
  for lp in out.logprobs or []:
    resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                      top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
  if with_prompt:
    resp.prompt_token_ids.extend(out.prompt_token_ids)
  if out.finished:
    resp.finish_reason = _FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    n = len(out.prompt_token_ids)
    resp.usage.CopyFrom(pb.Usage(prompt_tokens=n, completion_tokens=num_tokens,
                                 total_tokens=n + num_tokens))
    if out.stop_reason is not None:
      resp.stop_reason = str(out.stop_reason)
  return resp


async def _abort(context: grpc.aio.ServicerContext, e: APIError) -> None:
  code = _STATUS.get(e.status, grpc.StatusCode.INTERNAL)
  metadata = tuple((k.lower(), v) for k, v in (e.headers or {}).items())
  await context.abort(code, e.message, trailing_metadata=metadata)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
  """Rejects calls without `authorization: Bearer <key>` (health/reflection exempt)."""

  def __init__(self, api_key: str):
    self._key = api_key.encode()

  async def intercept_service(self, continuation: Callable[..., Any],
                              details: grpc.HandlerCallDetails) -> Any:
    handler = await continuation(details)
    if handler is None or details.method.startswith(_OPEN_PREFIXES):
      return handler
    metadata = dict(details.invocation_metadata or ())
    scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self._key):
      return handler
    return _deny_handler(handler)


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
  async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")

  async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")
    yield None  # unreachable; makes this an async generator

  kw = {"request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer}
  if handler.unary_stream:
    return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
  return grpc.unary_unary_rpc_method_handler(deny, **kw)


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
  """A request that is not a valid message of its type (bad UTF-8 in a string field,
  corrupt wire format) gets INVALID_ARGUMENT, not UNKNOWN with protobuf's exception.

  The handler receives the raw bytes and parses them itself, where a `DecodeError`
  can be answered properly (gRPC would otherwise fail the call before any handler).
  """

  async def intercept_service(self, continuation: Callable[..., Any],
                              details: grpc.HandlerCallDetails) -> Any:
    handler = await continuation(details)
    if handler is None or handler.request_deserializer is None or handler.request_streaming:
      return handler
    parse, kw = handler.request_deserializer, {"response_serializer": handler.response_serializer}
    if handler.unary_stream:
      inner = handler.unary_stream

      async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = await _parse_or_abort(parse, raw, context)
        async for response in inner(request, context):
          yield response

      return grpc.unary_stream_rpc_method_handler(stream, **kw)
    inner = handler.unary_unary

    async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
      return await inner(await _parse_or_abort(parse, raw, context), context)

    return grpc.unary_unary_rpc_method_handler(unary, **kw)


async def _parse_or_abort(parse: Callable[[bytes], Any], raw: bytes,
                          context: grpc.aio.ServicerContext) -> Any:
  try:
    return parse(raw)
  except DecodeError as e:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid "
                        f"message: {str(e).rsplit(': ', 1)[-1]}")


class GrpcServer:
  """The gRPC server: Generation + Health + reflection on one port."""

  def __init__(self, serving: OpenAIServing, model_name: str, *, api_key: str | None = None,
               max_message_bytes: int = 4 * 1024 * 1024, max_concurrent_rpcs: int = 1024):
    interceptors = [DecodeErrorInterceptor()] + ([ApiKeyInterceptor(api_key)] if api_key else [])
    self.server = grpc.aio.server(
        interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 # A port another server holds is an error, not shared with it.
                 ("grpc.so_reuseport", 0), *_KEEPALIVE_OPTIONS])
    pb_grpc.add_GenerationServicer_to_server(GenerationServicer(serving, model_name), self.server)
    self.health = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
    self.port: int | None = None

  def bind(self, host: str, port: int, *, tls_cert: str | None = None,
           tls_key: str | None = None) -> int:
    """Binds `host:port` (0 picks a free port); returns the bound port (BindError when
    it cannot be bound)."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
      if tls_cert:
        with open(tls_key, "rb") as f_key, open(tls_cert, "rb") as f_cert:
          creds = grpc.ssl_server_credentials([(f_key.read(), f_cert.read())])
        self.port = self.server.add_secure_port(address, creds)
      else:
        self.port = self.server.add_insecure_port(address)
    except RuntimeError as e:  # grpc's "Failed to bind to address ..."
      raise bind_error(f"gRPC port {port}", host, port, "failed to bind") from e
    if not self.port:
      raise bind_error(f"gRPC port {port}", host, port, "failed to bind")
    return self.port

  async def start(self) -> None:
    await self.server.start()
    await self.set_serving(True)

  async def set_serving(self, serving: bool) -> None:
    """The health status of the server and of the Generation service."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
      await self.health.set(name, status)

  async def stop(self, grace_s: float | None) -> None:
    """Marks NOT_SERVING, refuses new calls, lets running calls finish within `grace_s`."""
    await self.set_serving(False)
    await self.server.stop(grace_s)


def _validated(model: type, **fields: Any) -> Any:
  """A protocol model from message fields, or APIError 400 naming the bad field."""
  try:
    return model.model_validate(fields)
  except ValidationError as e:
    raise validation_error(e) from None
