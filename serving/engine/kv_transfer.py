"""KV page transfer between engines: the page format, the receiving side's write, and
the cross-process sender / receiver (the device operations, `jax.experimental.transfer`,
are serving/runner/kv_transport.py's `KVTransport`, handed in; this module holds no jax).

In one process (serving/engine/disaggregated.py) chunks move as device arrays
and only `import_chunk` is shared. Across processes (`xlaserve serve
--kv_role=prefill|decode`, the HTTP contract in serving/entrypoints/kv_connector.py)
a request's pages move like this:

  1. **Offer** (prefill server, `KVSender.pin`): at the one-token prefill's
     output, on the engine thread, the prompt's cached full pages are pinned
     (`match_prefix`, count=False) under a fresh offer id, for at most `timeout_s`.
  2. **Handshake** (decode server, `KVReceiver`): the prefill server's
     `KVPageFormat` (model, page size, KV dtype, page shape, chunk size) must
     equal the decode server's own, or nothing moves.
  3. **Chunks**: for each chunk of `kv_transfer_pages` pages the decode server
     asks the prefill server to export it (`KVSender.export`: the fixed-shape
     `runner.export_pages` copy, offered with `TransferServer.await_pull`
     under a random uuid; the pages are unpinned once the last chunk is
     copied) and pulls it with `TransferConnection.pull` into arrays of the
     same fixed shape on its own device, then writes and commits them
     (`import_chunk`) on its engine thread. Nothing compiles after warm-up.
  4. **Decode**: the decode server's prefix cache holds the prompt's full
     pages; it submits the request, which computes only the last partial page.
     The pull's references are dropped at the request's first output.

Failure: an offer nobody finishes is released by `KVSender.expire` after
`timeout_s`; a decode server that cannot pull (prefill server gone, mismatch,
timeout) keeps the chunks it wrote as ordinary cached pages and prefills the
rest itself (`KVTransferError`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from serving.engine.page_allocator import page_hash

log = logging.getLogger(__name__)


class KVTransferError(Exception):
  """A KV transfer that cannot go on (the request is then prefilled where it is)."""


@dataclasses.dataclass(frozen=True)
class KVPageFormat:
  """What both ends of a transfer must agree on (the handshake)."""

  model: str  # the model's name and shape: layers, KV heads, head dim, vocab
  page_size: int
  kv_dtype: str  # as stored
  chunk_shape: tuple[int, ...]  # one exported K (or V) chunk: [L, chunk, page_size, K, H']

  def to_json(self) -> dict[str, Any]:
    return {"model": self.model, "page_size": self.page_size, "kv_dtype": self.kv_dtype,
            "chunk_shape": list(self.chunk_shape)}

  @classmethod
  def from_json(cls, obj: dict[str, Any]) -> KVPageFormat:
    """ValueError if `obj` is not a page format."""
    try:
      return cls(str(obj["model"]), int(obj["page_size"]), str(obj["kv_dtype"]),
                 tuple(int(d) for d in obj["chunk_shape"]))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"not a KV page format: {obj!r}") from e

  def mismatch(self, other: KVPageFormat) -> str | None:
    """Why pages in format `other` cannot be written into a pool of this format."""
    for field in dataclasses.fields(self):
      mine, theirs = getattr(self, field.name), getattr(other, field.name)
      if mine != theirs:
        return f"{field.name} differs: {theirs!r} there, {mine!r} here"
    return None

  @property
  def chunk_pages(self) -> int:
    return self.chunk_shape[1]


def page_format(engine: Any) -> KVPageFormat:
  """The page format of an `LLMEngine` (its runner's `kv_page_spec`)."""
  shape, dtype, model = engine.runner.kv_page_spec()
  chunk = engine.config.parallel.kv_transfer_pages
  return KVPageFormat(f"{engine.model_name} {model}", engine.allocator.page_size, dtype,
                      (shape[0], chunk, *shape[1:]))


def prompt_hashes(prompt_ids: list[int], page_size: int) -> list[bytes]:
  """The prefix-cache hashes of the prompt's full pages (the last token left to compute),
  as `PageAllocator.match_prefix` computes them for the base model."""
  hashes, parent = [], None
  for i in range((len(prompt_ids) - 1) // page_size):
    parent = page_hash(parent, prompt_ids[i * page_size:(i + 1) * page_size])
    hashes.append(parent)
  return hashes


def import_chunk(engine: Any, hashes: list[bytes], prompt_ids: list[int], start: int,
                 k: Any, v: Any) -> list[int]:
  """On the decode engine's thread: pages for the prompt's full pages start.. (as many as
  `k` holds, whose hashes are hashes[start:...]), written and committed; each returned
  page holds one reference for the caller. A page already cached under its hash is reused,
  not written. RuntimeError when too few pages are free (nothing is then taken)."""
  count = min(len(hashes) - start, engine.config.parallel.kv_transfer_pages)
  chunk = hashes[start:start + count]
  got = engine.allocator.adopt(chunk)
  if got is None:
    raise RuntimeError(f"decode worker has no {len(chunk)} free KV pages for the transfer")
  pages, fresh = got
  try:
    engine.flush_evictions()  # pages `adopt` evicted go to the host tier before overwritten
    if any(fresh):  # pages it already caches are skipped (slot -> the dummy page)
      engine.runner.import_pages([p if f else 0 for p, f in zip(pages, fresh, strict=True)],
                                 k, v)
  except BaseException:
    engine.allocator.release(pages)  # fresh pages were never committed: freed
    raise
  ps = engine.allocator.page_size
  for i, (page, h, f) in enumerate(zip(pages, chunk, fresh, strict=True), start):
    if f:
      engine.allocator.commit(page, h, hashes[i - 1] if i else None,
                              prompt_ids[i * ps:(i + 1) * ps])
  return pages


@dataclasses.dataclass
class Offer:
  """A prompt's pinned pages on the prefill side, waiting for a decode server."""

  id: str
  pages: list[int]
  hashes: list[bytes]
  expires: float  # time.monotonic() after which the pages are released
  exported: set[int] = dataclasses.field(default_factory=set)  # chunk indices copied


class KVSender:
  """The prefill side: offers, chunk exports, expiry (module doc, steps 1 and 3)."""

  def __init__(self, engine: Any, transport: Any, timeout_s: float,
               clock: Callable[[], float] = time.monotonic):
    if not timeout_s > 0:
      raise ValueError(f"kv_transfer_timeout_s={timeout_s} must be positive")
    self.engine, self.transport, self.timeout_s = engine, transport, timeout_s
    self.clock = clock
    self.format = page_format(engine)
    self._offers: dict[str, Offer] = {}
    self._lock = threading.Lock()
    self.offers_total = self.expired_total = self.chunks_total = self.bytes_total = 0

  def pin(self, prompt_ids: list[int]) -> Offer | None:
    """On the engine thread, at the prefill leg's output (nothing can evict its pages
    before): pins the prompt's cached full pages -> the offer, or None when none is
    cached (a prompt shorter than a page)."""
    pages, hashes = self.engine.allocator.match_prefix(prompt_ids, count=False)
    if not pages:
      return None
    offer = Offer(secrets.token_hex(16), pages, hashes, self.clock() + self.timeout_s)
    with self._lock:
      self._offers[offer.id] = offer
      self.offers_total += 1
    return offer

  def export(self, offer_id: str, chunk: int, hashes: list[bytes]) -> int:
    """Copies chunk `chunk` of the offer and offers it for one pull -> the pull's uuid.
    `hashes`: the chunk's prefix hashes as the puller computed them (they must match).
    The pages are released once every chunk is copied. KeyError: no such offer (expired,
    released, never made); ValueError: a bad chunk or different tokens."""
    with self._lock:
      offer = self._offers.get(offer_id)
      if offer is None:
        raise KeyError(offer_id)
      per = self.format.chunk_pages
      if not 0 <= chunk < -(-len(offer.pages) // per) or chunk in offer.exported:
        raise ValueError(f"chunk {chunk} is not a chunk left to pull of this offer")
      if offer.hashes[chunk * per:(chunk + 1) * per] != hashes:
        raise ValueError(f"chunk {chunk}: the prompt's tokens differ from the offered ones")
      offer.exported.add(chunk)
      pages = offer.pages[chunk * per:(chunk + 1) * per]
      done = len(offer.exported) * per >= len(offer.pages)
    k, v = self.engine.call_soon(lambda: self.engine.runner.export_pages(pages)).result()
    uuid = secrets.randbits(62)
    nbytes = self.transport.offer(uuid, k, v, self.timeout_s)
    with self._lock:
      self.chunks_total += 1
      self.bytes_total += nbytes
    if done:
      self.release(offer_id)
    return uuid

  def release(self, offer_id: str) -> bool:
    """Unpins an offer's pages now (its transfer ended or was given up) -> whether it was
    pending."""
    with self._lock:
      offer = self._offers.pop(offer_id, None)
    if offer is None:
      return False
    self.engine.call_soon(lambda: self.engine.allocator.release(offer.pages))
    return True

  def expire(self) -> int:
    """Releases the offers past their deadline -> how many."""
    now = self.clock()
    with self._lock:
      stale = [o.id for o in self._offers.values() if o.expires <= now]
    n = sum(self.release(i) for i in stale)
    if n:
      log.warning("released %d KV offers no decode server pulled in %.0f s", n, self.timeout_s)
      with self._lock:
        self.expired_total += n
    return n

  @property
  def num_pending(self) -> int:
    with self._lock:
      return len(self._offers)


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
  """Where a request's prefilled pages wait (the decode side's view of kv_transfer_params)."""

  engine_id: str
  offer_id: str
  host: str
  port: int
  num_pages: int


# (method, url, json body or None, timeout_s) -> the JSON response; KVTransferError if none.
Fetch = Callable[[str, str, dict[str, Any] | None, float], dict[str, Any]]


class KVReceiver:
  """The decode side: handshake, pulls, writes (module doc, steps 2 and 3)."""

  def __init__(self, engine: Any, transport: Any, fetch: Fetch, timeout_s: float):
    self.engine, self.transport, self.fetch, self.timeout_s = engine, transport, fetch, timeout_s
    self.format = page_format(engine)
    self._peers: dict[tuple[str, int], tuple[str, Any]] = {}  # -> (engine id, connection)
    self._lock = threading.Lock()
    self.pulls_total = self.failures_total = self.pages_total = self.bytes_total = 0
    self.pull_seconds_total = 0.0  # in `pull`: handshake, HTTP, waits for both engines, wire
    self.wire_seconds_total = 0.0  # in `TransferConnection.pull` alone

  def pull(self, remote: RemotePrefill, prompt_ids: list[int]) -> list[int]:
    """Pulls the offered pages into this engine's pool (a blocking call: worker thread)
    -> the pages written, each holding one reference for the caller (release them once
    the request that uses them holds them). KVTransferError: nothing is held then; the
    chunks already written stay cached."""
    hashes = prompt_hashes(prompt_ids, self.format.page_size)[:remote.num_pages]
    held: list[int] = []
    start = time.perf_counter()
    try:
      conn = self._connect(remote)
      per = self.format.chunk_pages
      for chunk in range(-(-len(hashes) // per)):
        held += self._pull_chunk(remote, conn, hashes, prompt_ids, chunk)
    except BaseException as e:
      self._release(held)
      self._give_up(remote)
      with self._lock:
        self.failures_total += 1
      if isinstance(e, KVTransferError):
        raise
      raise KVTransferError(f"{type(e).__name__}: {e}") from e
    with self._lock:
      self.pulls_total += 1
      self.pages_total += len(held)
      self.pull_seconds_total += time.perf_counter() - start
    return held

  def release(self, pages: list[int]) -> None:
    """Drops the references `pull` handed over (on the engine thread, after the
    request that uses them was submitted)."""
    self._release(pages)

  def _release(self, pages: list[int]) -> None:
    if pages:
      self.engine.call_soon(lambda: self.engine.allocator.release(pages))

  def _connect(self, remote: RemotePrefill) -> Any:
    """The connection to the prefill server, after a handshake (once per peer)."""
    key = (remote.host, remote.port)
    with self._lock:
      peer = self._peers.get(key)
    if peer is None or peer[0] != remote.engine_id:
      info = self.fetch("GET", _url(remote, "/v1/kv_transfer/handshake"), None, self.timeout_s)
      try:
        theirs = KVPageFormat.from_json(info["format"])
        engine_id, address = str(info["engine_id"]), str(info["transfer_address"])
      except (KeyError, TypeError, ValueError) as e:
        raise KVTransferError(f"bad handshake from {key}: {e}") from None
      why = self.format.mismatch(theirs)
      if why is not None:
        raise KVTransferError(f"prefill server {engine_id} serves different KV pages: {why}")
      if engine_id != remote.engine_id:
        raise KVTransferError(f"{key} is engine {engine_id}, not {remote.engine_id}")
      peer = (engine_id, self.transport.connect(address))
      with self._lock:
        self._peers[key] = peer
    return peer[1]

  def _pull_chunk(self, remote: RemotePrefill, conn: Any, hashes: list[bytes],
                  prompt_ids: list[int], chunk: int) -> list[int]:
    per = self.format.chunk_pages
    body = {"remote_request_id": remote.offer_id, "chunk": chunk,
            "hashes": [h.hex() for h in hashes[chunk * per:(chunk + 1) * per]]}
    reply = self.fetch("POST", _url(remote, "/v1/kv_transfer/pull"), body, self.timeout_s)
    uuid = reply.get("uuid")
    if not isinstance(uuid, int):
      raise KVTransferError(f"bad pull reply: {reply!r}")
    start = time.perf_counter()
    k, v = _bounded(lambda: self.transport.pull(conn, uuid), self.timeout_s)
    with self._lock:
      self.bytes_total += k.nbytes + v.nbytes
      self.wire_seconds_total += time.perf_counter() - start
    return self.engine.call_soon(
        lambda: import_chunk(self.engine, hashes, prompt_ids, chunk * per, k, v)
    ).result(self.timeout_s)

  def _give_up(self, remote: RemotePrefill) -> None:
    """Tells the prefill server to unpin the offer (best effort: it may be gone)."""
    try:
      self.fetch("POST", _url(remote, "/v1/kv_transfer/release"),
                 {"remote_request_id": remote.offer_id}, min(self.timeout_s, 2.0))
    except KVTransferError:
      pass  # unreachable: its offer expires there (or went with it)


def _url(remote: RemotePrefill, path: str) -> str:
  host = f"[{remote.host}]" if ":" in remote.host else remote.host
  return f"http://{host}:{remote.port}{path}"


def _bounded(fn: Callable[[], Any], timeout_s: float) -> Any:
  """fn() in a helper thread, given up after `timeout_s` (a jax pull's own timeout does
  not end a pull of an array the other side never offers)."""
  box: dict[str, Any] = {}

  def run() -> None:
    try:
      box["value"] = fn()
    except BaseException as e:  # noqa: BLE001 -- handed to the caller
      box["error"] = e

  thread = threading.Thread(target=run, daemon=True, name="kv-pull")
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise KVTransferError(f"pull did not finish in {timeout_s:g} s")
  if "error" in box:
    raise KVTransferError(f"pull failed: {box['error']}") from box["error"]
  return box["value"]
