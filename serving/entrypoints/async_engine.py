"""asyncio bridge over an `EngineClient` shared by the HTTP, gRPC and batch front ends.

Lifecycle of one request:
  1. `submit()` checks admission (not draining, queue limit) and calls
     `engine.add_request`; a `ValueError` from the engine propagates unchanged
     (the front ends turn it into HTTP 400 / INVALID_ARGUMENT).
  2. The engine thread calls `on_output` with delta `RequestOutput`s; each is
     handed to the event loop with `call_soon_threadsafe` (never blocking the
     engine thread) and lands in the request's `asyncio.Queue`.
  3. The caller iterates the `RequestStream`; latencies are observed in
     `serving.entrypoints.metrics` as deltas arrive. The stream ends after the delta whose
     `finish_reason` is set.
  4. If the caller stops early (task cancelled, client gone, deadline passed),
     `RequestStream.abort()` (called by `generate()` / `async with`) calls
     `engine.abort`, which frees the request's KV pages before the next step.
If the engine can no longer serve (`engine.health()`, watched by the server),
`fail_all(reason)` ends every stream with an error at once, and `submit`
refuses new requests with `EngineUnavailableError` (HTTP 503 / UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.engine import EngineClient, EngineDeadError
from serving.entrypoints.metrics import Metrics, RequestTimer
from serving.types import RequestOutput, SamplingParams


class ServerBusyError(Exception):
  """The queue limit is reached (HTTP 429 / gRPC RESOURCE_EXHAUSTED)."""

  def __init__(self, message: str, retry_after_s: int = 1):
    super().__init__(message)
    self.retry_after_s = retry_after_s


class ServerDrainingError(Exception):
  """The server is shutting down and takes no new requests (HTTP 503 / UNAVAILABLE)."""


class EngineUnavailableError(Exception):
  """The engine is dead or wedged: nothing can be served (HTTP 503 / UNAVAILABLE)."""


class RequestStream:
  """Async iterator over one request's delta outputs; `abort()` if abandoned.

  `abort_request(request_id)` aborts it in the engine; `on_close(request_id)` is
  called once when the stream leaves the front end's accounting.
  """

  def __init__(self, request_id: str, timer: RequestTimer | None, *,
               abort_request: Callable[[str], None], on_close: Callable[[str], None]):
    self.request_id = request_id
    self._timer = timer
    self._abort_request, self._on_close = abort_request, on_close
    self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    self.finished = False  # the final delta was returned
    self._closed = False  # released from the front end's accounting

  @property
  def closed(self) -> bool:
    """Released from the front end's accounting (finished, aborted or failed)."""
    return self._closed

  def put(self, out: RequestOutput) -> None:
    """Queues a delta for the consumer (the event loop's thread only)."""
    self._queue.put_nowait(out)

  def __aiter__(self) -> RequestStream:
    return self

  async def __anext__(self) -> RequestOutput:
    if self.finished:
      raise StopAsyncIteration
    out = await self._queue.get()
    if self._timer is not None and not self._closed:
      self._timer.on_tokens(len(out.token_ids))
    if out.finished:
      self.finished = True
      self.close(out.finish_reason)
    return out

  async def __aenter__(self) -> RequestStream:
    return self

  async def __aexit__(self, *exc: Any) -> None:
    self.abort()

  def abort(self) -> None:
    """Aborts the request in the engine unless it already finished (idempotent)."""
    if not self._closed:
      self._abort_request(self.request_id)
      self.close("abort")

  def close(self, finish_reason: str) -> None:
    """Leaves the front end's accounting, counted as `finish_reason` (idempotent); the
    engine is not told (see `abort`)."""
    if self._closed:
      return
    self._closed = True
    if self._timer is not None:
      self._timer.on_finish(finish_reason)
    self._on_close(self.request_id)


class AsyncEngine:
  """Owns an `EngineClient` and exposes `submit()` / `generate()` to asyncio code.

  `max_queued_requests` bounds the requests admitted beyond the engine's
  decode slots (`max_num_seqs`); None means unbounded.
  """

  def __init__(self, engine: EngineClient, *, metrics: Metrics | None = None,
               max_queued_requests: int | None = None):
    self.engine = engine
    self.metrics = metrics
    self.max_queued_requests = max_queued_requests
    self._streams: dict[str, RequestStream] = {}
    self._idle = asyncio.Event()
    self._idle.set()
    self.draining = False
    self.unavailable: str | None = None  # why the engine cannot serve (set by fail_all)

  @property
  def tokenizer(self) -> Any:
    return self.engine.tokenizer

  @property
  def max_model_len(self) -> int:
    return self.engine.max_model_len

  @property
  def capacity(self) -> int | None:
    """Most requests admitted at once (decode slots + queue), None if unbounded."""
    if self.max_queued_requests is None:
      return None
    return self.engine.num_slots + self.max_queued_requests

  @property
  def num_inflight(self) -> int:
    return len(self._streams)

  def submit(self, prompt: str | list[int], params: SamplingParams,
             request_id: str | None = None, lora: str | None = None,
             on_first_output: Callable[[], None] | None = None) -> RequestStream:
    """Admits a request (under LoRA adapter `lora`, if given); raises
    EngineUnavailableError, ServerDrainingError, ServerBusyError or ValueError.
    `on_first_output` runs on the engine thread at the request's first output (every
    admitted request has one, if only its finish), not at all if admission fails."""
    if self.unavailable is not None:
      self._reject("unavailable")
      raise EngineUnavailableError(f"the engine cannot serve: {self.unavailable}")
    if self.draining:
      self._reject("draining")
      raise ServerDrainingError("server is shutting down")
    limit = self.capacity
    if limit is not None:
      if len(self._streams) >= limit:
        self._reject("queue_full")
        raise ServerBusyError(f"server is at its queue limit ({limit} requests); retry later")
    request_id = request_id or f"req-{uuid.uuid4().hex}"
    if request_id in self._streams:
      raise ValueError(f"duplicate request id {request_id!r}")
    timer = self.metrics.timer() if self.metrics is not None else None
    stream = RequestStream(request_id, timer, abort_request=self.engine.abort,
                           on_close=self._release)
    loop = asyncio.get_running_loop()

    def on_output(out: RequestOutput) -> None:  # engine thread
      nonlocal on_first_output
      if on_first_output is not None:
        hook, on_first_output = on_first_output, None
        hook()
      try:
        loop.call_soon_threadsafe(stream.put, out)
      except RuntimeError:  # the loop is closed: nobody listens any more
        return

    self._streams[request_id] = stream
    self._idle.clear()
    try:
      self.engine.add_request(request_id, prompt, params, on_output, lora=lora)
    except EngineDeadError as e:
      self._release(request_id)
      raise EngineUnavailableError(f"the engine cannot serve: {e}") from None
    except BaseException:
      self._release(request_id)
      raise
    return stream

  async def generate(self, prompt: str | list[int], params: SamplingParams,
                     request_id: str | None = None, lora: str | None = None
                     ) -> AsyncIterator[RequestOutput]:
    """Yields delta outputs; aborts the request if the consumer stops early."""
    stream = self.submit(prompt, params, request_id, lora)
    try:
      async for out in stream:
        yield out
    finally:
      stream.abort()

  def _release(self, request_id: str) -> None:
    self._streams.pop(request_id, None)
    if not self._streams:
      self._idle.set()

  def _reject(self, reason: str) -> None:
    if self.metrics is not None:
      self.metrics.reject(reason)

  # Draining -----------------------------------------------------------------

  def stop_accepting(self) -> None:
    self.draining = True

  async def wait_idle(self, timeout: float | None) -> bool:
    """Waits until no request is in flight; False on timeout."""
    try:
      await asyncio.wait_for(self._idle.wait(), timeout)
    except TimeoutError:
      return False
    return True

  def abort_all(self) -> None:
    for stream in list(self._streams.values()):
      stream.abort()

  def fail_all(self, reason: str) -> None:
    """The engine cannot serve: refuse new requests and end every stream with `reason`
    now, without waiting for the engine (which may be stuck in a device call)."""
    self.unavailable = reason
    for stream in list(self._streams.values()):
      stream.put(RequestOutput(
          request_id=stream.request_id, prompt_token_ids=[], text="", token_ids=[],
          finish_reason="error", error=f"the engine cannot serve: {reason}"))
      self.engine.abort(stream.request_id)
      stream.close("error")
