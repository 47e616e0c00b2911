"""Offline batch jobs over OpenAI batch-format JSONL (`xlaserve batch`).

Input lines: `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}`. Output lines, in input order:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}` where `body` is exactly what the HTTP server would return (the same
`OpenAIServing` code path); a line that is not a valid request gets
`response: null` and `error: {"code", "message"}`. A request that is invalid gets
its 4xx body (only that line); a line the server failed to answer (5xx: an
engine error, the engine gone) is written with its 500/503 body and counted in
`failed`: the job then exits non-zero, and a rerun starts over from the first
such line.

Lifecycle:
  1. Resume: output lines already written (a prefix of the input, checked by
     custom_id) are kept up to the first server-side failure; a torn last line
     from a killed run is cut off.
  2. The remaining lines run concurrently (`max_concurrency` in flight), so
     the engine batches them.
  3. Results are written strictly in input order: a finished line waits in
     a buffer until every earlier line is written; each line is one write
     followed by a flush, so a killed job loses at most the lines in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import uuid
from typing import Any, TextIO

from pydantic import ValidationError
from tqdm import tqdm

from serving.engine import EngineClient
from serving.entrypoints.async_engine import AsyncEngine
from serving.entrypoints.limits import RequestLimits
from serving.entrypoints.openai_protocol import (
  APIError,
  ChatCompletionRequest,
  CompletionRequest,
  parse_json_object,
  validation_error,
)
from serving.entrypoints.openai_serving import OpenAIServing

ROUTES = {"/v1/chat/completions": ("chat", ChatCompletionRequest),
          "/v1/completions": ("completion", CompletionRequest)}


@dataclasses.dataclass(frozen=True)
class BatchConfig:
  input_path: str
  output_path: str
  served_model_name: str
  max_concurrency: int = 16
  show_progress: bool = True
  limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

  def __post_init__(self):
    if self.max_concurrency < 1:
      raise ValueError(f"max_concurrency={self.max_concurrency} must be at least 1")
    if os.path.abspath(self.input_path) == os.path.abspath(self.output_path):
      raise ValueError("input and output must be different files")


async def run_batch(engine: EngineClient, cfg: BatchConfig) -> dict[str, int]:
  """Runs every not-yet-done line of the input; returns a summary of counts
  (`failed`: lines the server could not answer, to be redone by a rerun)."""
  with open(cfg.input_path, encoding="utf-8") as f:
    lines = [line for line in f.read().splitlines() if line.strip()]
  done = resume_point(cfg.output_path, lines)
  engine.start()
  try:
    names = [n for n in dict.fromkeys([cfg.served_model_name, engine.model_name]) if n]
    serving = OpenAIServing(AsyncEngine(engine), names, cfg.limits)
    with open(cfg.output_path, "a", encoding="utf-8") as out, \
        tqdm(total=len(lines), initial=done, unit="req", disable=not cfg.show_progress,
             desc="batch") as bar:
      writer = OrderedWriter(out, next_index=done, on_write=lambda: bar.update(1))
      limit = asyncio.Semaphore(cfg.max_concurrency)
      failed = 0

      async def one(i: int) -> None:
        nonlocal failed
        async with limit:
          result = await process_line(serving, lines[i])
        failed += _server_failed(result)
        writer.put(i, result)

      await asyncio.gather(*(one(i) for i in range(done, len(lines))))
  finally:
    engine.shutdown()
  return {"total": len(lines), "skipped": done, "processed": len(lines) - done,
          "failed": failed}


def _server_failed(result: dict[str, Any]) -> bool:
  """The server could not answer this line (a rerun should redo it)."""
  response = result.get("response")
  return isinstance(response, dict) and response.get("status_code", 0) >= 500


class OrderedWriter:
  """Writes results strictly in index order, buffering ones that finish early."""

  def __init__(self, out: TextIO, next_index: int, on_write: Any = None):
    self._out, self._next, self._pending = out, next_index, {}
    self._on_write = on_write

  def put(self, index: int, result: dict[str, Any]) -> None:
    self._pending[index] = json.dumps(result, ensure_ascii=False) + "\n"
    while self._next in self._pending:
      self._out.write(self._pending.pop(self._next))
      self._out.flush()
      self._next += 1
      if self._on_write is not None:
        self._on_write()


def resume_point(output_path: str, lines: list[str]) -> int:
  """How many input lines the existing output already answers (torn tail cut off)."""
  if not os.path.exists(output_path):
    return 0
  with open(output_path, "rb") as f:
    data = f.read()
  done, keep = 0, 0
  for raw in data.split(b"\n")[:-1]:  # the last piece has no newline: torn or empty
    try:
      written = json.loads(raw)
      got = written.get("custom_id")
    except (ValueError, RecursionError, AttributeError):  # torn or not ours
      break
    if _server_failed(written):  # redo it, and everything after it
      break
    if done >= len(lines):
      raise ValueError(f"{output_path} has more results than {len(lines)} input lines")
    if got != _custom_id(lines[done]):
      raise ValueError(f"{output_path} line {done + 1} answers custom_id {got!r}, but input line "
                       f"{done + 1} is {_custom_id(lines[done])!r}: use a fresh output file")
    done, keep = done + 1, keep + len(raw) + 1
  if keep != len(data):
    with open(output_path, "r+b") as f:
      f.truncate(keep)
  return done


def _custom_id(line: str) -> Any:
  try:
    obj = json.loads(line)
  except (ValueError, RecursionError):  # a bad line has no custom_id
    return None
  return obj.get("custom_id") if isinstance(obj, dict) else None


async def process_line(serving: OpenAIServing, line: str) -> dict[str, Any]:
  """One output line for one input line (errors become error lines, never raise)."""
  result: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None,
                            "response": None, "error": None}
  try:
    obj = await asyncio.to_thread(parse_json_object, line, "line")
  except APIError as e:
    result["error"] = {"code": e.code, "message": e.message}
    return result
  if not isinstance(obj.get("body"), dict):
    result["error"] = {"code": "invalid_request", "message": "line must be an object with a body"}
    return result
  result["custom_id"] = obj.get("custom_id")
  route = ROUTES.get(obj.get("url"))
  if route is None or obj.get("method", "POST") != "POST":
    result["error"] = {"code": "invalid_url",
                       "message": f"url must be one of {sorted(ROUTES)} with method POST"}
    return result
  kind, model = route
  try:
    if obj["body"].get("stream"):
      raise APIError(400, "stream is not supported in batch jobs", param="stream")
    job = await asyncio.to_thread(_prepare, serving, kind, model, obj["body"])
    body, status, request_id = await serving.run(job), 200, job.id
  except APIError as e:
    body, status, request_id = e.body(), e.status, None
  result["response"] = {"status_code": status, "request_id": request_id, "body": body}
  return result


def _prepare(serving: OpenAIServing, kind: str, model: Any, body: dict[str, Any]) -> Any:
  """A validated, tokenized job from a line's body (worker-thread CPU work)."""
  serving.precheck(body)
  try:
    req = model.model_validate(body)
  except ValidationError as e:
    raise validation_error(e) from None
  return serving.prepare_chat(req) if kind == "chat" else serving.prepare_completion(req)
