"""Prefill / decode across servers over HTTP: vLLM's `kv_transfer_params` contract.

`xlaserve serve --kv_role=prefill` and `--kv_role=decode` make a `KVConnector`
beside the engine (serving/engine/kv_transfer.py moves the pages). A proxy
(serving/tools/pd_proxy.py, vLLM's P/D proxy, llm-d's routing sidecar) runs a
request in two legs:

  1. To a prefill server, with `kv_transfer_params: {"do_remote_decode": true}`
     and `max_tokens: 1` (not streamed). It prefills, pins the prompt's full
     pages at its output (`KVSender.pin`, on the engine thread, before anything
     can evict them) and answers with
     `kv_transfer_params: {do_remote_prefill: true, do_remote_decode: false,
     remote_engine_id, remote_request_id, remote_block_ids, remote_host,
     remote_port}`: its engine id, the offer's id, the pinned page ids, and its
     own HTTP address (the side channel below).
  2. The original request plus those params, to a decode server. Before
     submitting it, the decode server pulls the pages (`KVReceiver.pull`),
     streams or returns the completion as usual. If it cannot pull (the
     prefill server is gone, the transfer fails or times out, the handshake
     finds a different model / page size / KV dtype / layout), it prefills the
     request itself: the request still succeeds.

The prefill server's side channel (same port, same API key as the API):
`GET /v1/kv_transfer/handshake` (engine id, page format, transfer server
address), `POST /v1/kv_transfer/pull` (copy one chunk of an offer, -> the uuid
to pull it under), `POST /v1/kv_transfer/release` (the decode server gives
up), and on both roles `GET /v1/kv_transfer/stats` (counters).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from serving.engine.kv_transfer import (
  KVReceiver,
  KVSender,
  KVTransferError,
  Offer,
  RemotePrefill,
  page_format,
)
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.openai_protocol import APIError, KVTransferParams
from serving.runner.kv_transport import KVTransport

log = logging.getLogger(__name__)
_WILDCARDS = ("0.0.0.0", "::", "")
MAX_BODY_BYTES = 1 << 20  # a side-channel body: one chunk's hashes


class KVConnector:
  """One server's end of cross-server prefill / decode (module doc)."""

  def __init__(self, engine: Any, role: str, *, timeout_s: float, host: str,
               api_key: str | None = None):
    if not isinstance(engine, LLMEngine):
      raise ValueError(f"kv_role={role!r} serves one engine (not {type(engine).__name__})")
    if engine.window is not None:
      raise ValueError("kv_role prefill / decode does not serve hybrid-attention models yet")
    if jax.process_count() > 1:
      raise ValueError(f"kv_role={role!r} serves from one process (not a multi-host mesh)")
    if role not in ("prefill", "decode"):
      raise ValueError(f"a KV connector's role is prefill or decode, not {role!r}")
    self.engine, self.role, self.timeout_s, self.api_key = engine, role, timeout_s, api_key
    self.host = "127.0.0.1" if host in _WILDCARDS else host
    self.engine_id = f"xlaserve-{secrets.token_hex(8)}"
    fmt = page_format(engine)
    self.transport = KVTransport(self.host, fmt.chunk_shape, fmt.kv_dtype)
    self.port: int | None = None  # the HTTP port, once bound (`bind`)
    self.sender = KVSender(engine, self.transport, timeout_s) if role == "prefill" else None
    self.receiver = (KVReceiver(engine, self.transport, self._fetch, timeout_s)
                     if role == "decode" else None)

  def bind(self, port: int) -> None:
    """The HTTP port the side channel is served on (known once uvicorn listens)."""
    self.port = port

  # ---- the two legs (blocking: worker threads) ----

  def offers_for(self, params: KVTransferParams | None) -> bool:
    """Whether a request with these params is a prefill leg this server answers."""
    return self.sender is not None and params is not None and params.do_remote_decode

  def pulls_for(self, params: KVTransferParams | None) -> bool:
    """Whether a request with these params is a decode leg whose pages this server pulls."""
    return (self.receiver is not None and params is not None and params.do_remote_prefill
            and bool(params.remote_block_ids))

  def pin_at_first_output(self, prompt_ids: list[int],
                          pinned: Callable[[Offer | None], None]) -> Callable[[], None]:
    """A hook pinning a prefill leg's pages on the engine thread at the request's first
    output (`AsyncEngine.submit`'s on_first_output), while they are still cached for
    certain; `pinned` gets the offer (None: no full page)."""
    return lambda: pinned(self.sender.pin(prompt_ids))

  def unpin(self, offer: Offer | None) -> None:
    """Releases an offer whose request failed (nobody will pull it)."""
    if offer is not None:
      self.sender.release(offer.id)

  def params(self, offer: Offer | None) -> dict[str, Any]:
    """A prefill leg's response kv_transfer_params for its pinned offer."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": offer.id if offer else None,
            "remote_block_ids": list(offer.pages) if offer else [],
            "remote_host": self.host, "remote_port": self.port}

  def pull(self, params: KVTransferParams, prompt_ids: list[int]) -> list[int]:
    """Pulls a decode leg's pages -> the pages held for it ([] when it could not: the
    request is then prefilled here)."""
    remote = RemotePrefill(params.remote_engine_id, params.remote_request_id,
                           params.remote_host, params.remote_port,
                           len(params.remote_block_ids))
    try:
      return self.receiver.pull(remote, prompt_ids)
    except KVTransferError as e:
      log.warning("KV pull from %s:%s failed (%s); prefilling here", remote.host, remote.port, e)
      return []

  def release(self, pages: list[int]) -> None:
    """Drops the references `pull` handed over (any thread)."""
    if pages:
      self.receiver.release(pages)

  def release_at_first_output(self, pages: list[int]) -> Callable[[], None]:
    """A hook dropping `pull`'s references on the engine thread, given to the request
    that uses the pages (`AsyncEngine.submit`'s on_first_output): by its first output it
    holds them itself, and until then no other request can evict them."""
    allocator = self.engine.allocator
    return lambda: allocator.release(pages)

  # ---- the prefill side's side channel ----

  def handshake(self) -> dict[str, Any]:
    return {"engine_id": self.engine_id, "format": self.sender.format.to_json(),
            "transfer_address": self.transport.address()}

  def serve_pull(self, body: dict[str, Any]) -> dict[str, Any]:
    offer_id, chunk, hashes = body.get("remote_request_id"), body.get("chunk"), body.get("hashes")
    if (not isinstance(offer_id, str) or not isinstance(chunk, int) or isinstance(chunk, bool)
        or not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes)):
      raise APIError(400, "a pull names remote_request_id (string), chunk (integer) and "
                     "hashes (hex strings)")
    try:
      digests = [bytes.fromhex(h) for h in hashes]
      return {"uuid": self.sender.export(offer_id, chunk, digests)}
    except KeyError:
      raise APIError(404, f"no pending KV offer {offer_id!r} (expired or released)",
                     code="not_found") from None
    except ValueError as e:
      raise APIError(409, str(e), code="kv_mismatch") from None

  def serve_release(self, body: dict[str, Any]) -> dict[str, Any]:
    offer_id = body.get("remote_request_id")
    if not isinstance(offer_id, str):
      raise APIError(400, "a release names remote_request_id (string)")
    return {"released": self.sender.release(offer_id)}

  def stats(self) -> dict[str, Any]:
    """Counters of this side (pending offers, chunks, bytes; pulls, failures, seconds)."""
    out: dict[str, Any] = {"role": self.role, "engine_id": self.engine_id}
    if self.sender is not None:
      s = self.sender
      out.update(pending_offers=s.num_pending, offers_total=s.offers_total,
                 offers_expired_total=s.expired_total, chunks_total=s.chunks_total,
                 bytes_total=s.bytes_total)
    if self.receiver is not None:
      r = self.receiver
      out.update(pulls_total=r.pulls_total, pull_failures_total=r.failures_total,
                 pages_total=r.pages_total, bytes_total=r.bytes_total,
                 pull_seconds_total=r.pull_seconds_total,
                 wire_seconds_total=r.wire_seconds_total)
    return out

  async def expire_loop(self) -> None:
    """Releases offers nobody pulled in time, for as long as the server runs."""
    while True:
      await asyncio.sleep(min(1.0, self.timeout_s / 4))
      if self.sender is not None:
        self.sender.expire()

  def _fetch(self, method: str, url: str, body: dict[str, Any] | None,
             timeout_s: float) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if self.api_key:
      headers["Authorization"] = f"Bearer {self.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
      with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())
    except urllib.error.HTTPError as e:
      raise KVTransferError(f"{method} {url}: HTTP {e.code} {e.read()[:300]!r}") from None
    except (OSError, ValueError) as e:
      raise KVTransferError(f"{method} {url}: {e}") from None


def add_kv_routes(app: FastAPI, connector: KVConnector, authorize: Any) -> None:
  """The side channel's routes (module doc) on the server's app."""

  async def body_of(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
      raise APIError(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
    try:
      obj = json.loads(raw)
    except ValueError:
      raise APIError(400, "the body is not JSON") from None
    if not isinstance(obj, dict):
      raise APIError(400, "the body is not a JSON object")
    return obj

  def prefill_only() -> None:
    if connector.sender is None:
      raise APIError(404, "this server does not offer KV pages (--kv_role=prefill does)",
                     code="not_found")

  @app.get("/v1/kv_transfer/handshake")
  async def handshake(request: Request) -> Response:
    authorize(request)
    prefill_only()
    return JSONResponse(connector.handshake())

  @app.post("/v1/kv_transfer/pull")
  async def pull(request: Request) -> Response:
    authorize(request)
    prefill_only()
    body = await body_of(request)
    return JSONResponse(await asyncio.to_thread(connector.serve_pull, body))

  @app.post("/v1/kv_transfer/release")
  async def release(request: Request) -> Response:
    authorize(request)
    prefill_only()
    return JSONResponse(connector.serve_release(await body_of(request)))

  @app.get("/v1/kv_transfer/stats")
  async def stats(request: Request) -> Response:
    authorize(request)
    return JSONResponse(connector.stats())
