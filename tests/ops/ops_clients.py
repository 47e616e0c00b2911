"""Small asyncio clients for the operations tests: SSE streams and gRPC Generate calls."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import grpc
import httpx

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc

MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass
class StreamResult:
  """What one streaming completion delivered."""

  status: int
  text: str = ""
  chunks: int = 0
  finish_reason: str | None = None
  done: bool = False  # saw `data: [DONE]`
  error: dict[str, Any] | None = None
  headers: dict[str, str] = dataclasses.field(default_factory=dict)
  seconds: float = 0.0


def completion_body(prompt: str | list[int], max_tokens: int, stream: bool = True,
                    **extra: Any) -> dict[str, Any]:
  return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
          "stream": stream, **extra}


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any], *,
                            cancel_after_chunks: int | None = None,
                            read_delay_s: float = 0.0) -> StreamResult:
  """POSTs a streaming completion and reads its SSE events.

  `cancel_after_chunks`: close the connection after that many text chunks
  (the server must abort the request). `read_delay_s`: a slow reader.
  """
  loop = asyncio.get_running_loop()
  start = loop.time()
  async with client.stream("POST", "/v1/completions", json=body) as r:
    res = StreamResult(status=r.status_code, headers=dict(r.headers))
    if r.status_code != 200:
      res.error = json.loads(await r.aread())["error"]
      return res
    async for line in r.aiter_lines():
      if not line.startswith("data: "):
        continue
      if line == "data: [DONE]":
        res.done = True
        break
      event = json.loads(line[len("data: "):])
      if "error" in event:
        res.error = event["error"]
        continue
      choice = event["choices"][0]
      res.text += choice["text"]
      res.chunks += 1
      res.finish_reason = choice["finish_reason"] or res.finish_reason
      if cancel_after_chunks is not None and res.chunks >= cancel_after_chunks:
        break
      if read_delay_s:
        await asyncio.sleep(read_delay_s)
  res.seconds = loop.time() - start
  return res


def grpc_request(prompt: str | list[int], max_tokens: int) -> pb.GenerateRequest:
  sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
  if isinstance(prompt, str):
    return pb.GenerateRequest(text=prompt, sampling=sampling)
  return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


async def grpc_generate(stub: pb_grpc.GenerationStub, req: pb.GenerateRequest,
                        metadata: tuple = ()) -> tuple[grpc.StatusCode, str, dict[str, str]]:
  """Runs one Generate call to the end: (status code, text, trailing metadata)."""
  call = stub.Generate(req, metadata=metadata)
  text = ""
  try:
    async for msg in call:
      text += msg.text
  except grpc.aio.AioRpcError as e:
    return e.code(), e.details() or "", dict(e.trailing_metadata() or ())
  return grpc.StatusCode.OK, text, dict(await call.trailing_metadata() or ())
