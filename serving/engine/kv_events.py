"""KV-cache events for prefix-aware routers: vLLM's event shapes over a ZMQ PUB socket.

A router (llm-d's KV-cache indexer, Dynamo's KV router) mirrors which prefix
pages each server caches from a stream of events, in vLLM's format
(docs/kv_events.md):

  1. `KVEventRecorder`, a `CacheListener` on an engine's `PageAllocator`, turns
     every store / evict / clear into a `BlockStored` / `BlockRemoved` /
     `AllBlocksCleared` on the engine thread (a list append; consecutive pages
     of one chain share one event, as vLLM's do).
  2. At the end of each engine step `flush()` hands the step's events, as one
     batch, to the `KVEventPublisher`: a sequence number and a bounded queue,
     never a wait. A full queue drops the batch and counts it
     (`dropped_batches`); its sequence number is never sent, so subscribers
     see the gap.
  3. The publisher's thread encodes each batch (msgpack, `encode_batch`) and
     sends it as vLLM does: multipart [topic, 8-byte big-endian sequence
     number, payload] on a PUB socket (a slow or absent subscriber loses
     messages past the high-water mark; PUB never blocks). An optional ROUTER
     socket replays the last `replay_batches` batches from a sequence number.

Block hashes are the prefix cache's own (`page_hash`, 16-byte blake2b) sent as
vLLM sends its hashes by default: the unsigned 64-bit integer of the digest's
last 8 bytes, big-endian (`wire_hash`), which is also how llm-d reads a
byte-string hash.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import msgpack
import zmq

from serving.engine.page_allocator import CacheListener

log = logging.getLogger(__name__)

EVENT_FORMATS = ("array", "map")  # positional events (vLLM before PR 42892) | tagged maps
MEDIUM_DEVICE = "GPU"  # vLLM's name for the accelerator's KV pool (its MEDIUM_GPU)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_LORA_SALT = b"lora:"  # Sequence.cache_salt roots an adapter's hash chains


def wire_hash(h: bytes) -> int:
  """A 16-byte prefix hash as it appears on the wire: the unsigned 64-bit integer of its
  last 8 bytes, big-endian (vLLM's default int block hashes; llm-d folds bytes the same)."""
  return int.from_bytes(h[-8:], "big")


@dataclasses.dataclass
class BlockStored:
  """Full pages newly cached: `block_hashes` in chain order, `parent_block_hash` the page
  before the first (None: the first page of a prompt), `token_ids` all their tokens."""

  block_hashes: list[bytes]
  parent_block_hash: bytes | None
  token_ids: list[int]
  block_size: int
  lora_id: int | None
  medium: str | None = MEDIUM_DEVICE
  lora_name: str | None = None


@dataclasses.dataclass
class BlockRemoved:
  """Cached pages evicted (their hashes)."""

  block_hashes: list[bytes]
  medium: str | None = MEDIUM_DEVICE


@dataclasses.dataclass
class AllBlocksCleared:
  """Every cached page dropped at once (`reset_prefix_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def event_fields(event: KVEvent) -> list[tuple[str, object]]:
  """(name, wire value) of an event's fields in vLLM's declaration order."""
  if isinstance(event, BlockStored):
    parent = None if event.parent_block_hash is None else wire_hash(event.parent_block_hash)
    return [("block_hashes", [wire_hash(h) for h in event.block_hashes]),
            ("parent_block_hash", parent), ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size), ("lora_id", event.lora_id),
            ("medium", event.medium), ("lora_name", event.lora_name)]
  if isinstance(event, BlockRemoved):
    return [("block_hashes", [wire_hash(h) for h in event.block_hashes]),
            ("medium", event.medium)]
  return []


def encode_event(event: KVEvent, fmt: str) -> list | dict:
  """One event as msgspec encodes vLLM's tagged structs: "map" -> {"type": tag, **fields}
  (vLLM today); "array" -> [tag, *fields] (array_like=True) with BlockStored's fields of
  vLLM 0.11, up to `medium`: array decoders check the field count (llm-d's rejects any
  other), and consumers that know later fields take missing trailing ones as nil."""
  tag = type(event).__name__
  fields = event_fields(event)
  if fmt == "array":
    return [tag, *(v for name, v in fields if name != "lora_name")]
  return {"type": tag, **dict(fields)}


def encode_batch(ts: float, events: list[KVEvent], data_parallel_rank: int,
                 fmt: str = "array") -> bytes:
  """A `KVEventBatch` payload: the array [ts, [events...], data_parallel_rank]."""
  if fmt not in EVENT_FORMATS:
    raise ValueError(f"kv_events_format={fmt!r} not in {EVENT_FORMATS}")
  return msgpack.packb([float(ts), [encode_event(e, fmt) for e in events],
                        data_parallel_rank], use_bin_type=True)


def binds(endpoint: str) -> bool:
  """vLLM's rule: a wildcard host (`*`, `::`), ipc:// or inproc:// endpoint is bound
  (subscribers connect to it); any other (tcp://indexer:5557) is connected to."""
  return ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")))


class KVEventPublisher:
  """The PUB socket (and optional replay ROUTER socket) and the thread that feeds them.

  Sockets are set up in the constructor, so a bad or busy endpoint raises
  `zmq.ZMQError` there, before serving; `start()` starts the sending thread.
  `publish` never blocks (see the module docstring).
  """

  def __init__(self, endpoint: str, *, topic: str = "", replay_endpoint: str | None = None,
               fmt: str = "array", max_queue_batches: int = 10_000,
               replay_batches: int = 10_000, hwm: int = 100_000):
    if fmt not in EVENT_FORMATS:
      raise ValueError(f"kv_events_format={fmt!r} not in {EVENT_FORMATS}")
    self.endpoint, self.fmt = endpoint, fmt
    self._topic = topic.encode()
    self._queue: queue.Queue = queue.Queue(maxsize=max_queue_batches)
    self._replay_buffer: collections.deque[tuple[int, bytes]] = collections.deque(
        maxlen=replay_batches)
    self._seq_lock = threading.Lock()
    self._next_seq = 0
    self.published_batches = 0
    self.dropped_batches = 0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._ctx = zmq.Context()
    self._pub = self._ctx.socket(zmq.PUB)
    self._replay = None
    try:
      self._pub.set_hwm(hwm)
      self._pub.setsockopt(zmq.LINGER, 0)
      (self._pub.bind if binds(endpoint) else self._pub.connect)(endpoint)
      if replay_endpoint is not None:
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(replay_endpoint)
    except zmq.ZMQError:
      self._close_sockets()
      raise

  def start(self) -> None:
    """Starts the sending thread (idempotent)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name="xlaserve-kv-events",
                                      daemon=True)
      self._thread.start()

  def publish(self, events: list[KVEvent], data_parallel_rank: int = 0) -> bool:
    """Queues one batch under the next sequence number; False (dropped, counted) when the
    queue is full. Any thread; never blocks."""
    with self._seq_lock:
      seq, self._next_seq = self._next_seq, self._next_seq + 1
      try:
        self._queue.put_nowait((seq, time.time(), list(events), data_parallel_rank))
      except queue.Full:
        self.dropped_batches += 1
        if self.dropped_batches == 1 or self.dropped_batches % 1000 == 0:
          log.warning("KV event queue full: %d batches dropped so far", self.dropped_batches)
        return False
    return True

  def close(self, timeout_s: float = 2.0) -> None:
    """Sends what is queued (up to `timeout_s`), stops the thread, closes the sockets
    (idempotent)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=timeout_s)
      if self._thread.is_alive():
        log.warning("KV event publisher still busy after %.1f s; its thread is left to "
                    "finish", timeout_s)
        return
      self._thread = None
    self._close_sockets()

  def _close_sockets(self) -> None:
    for sock in (self._pub, self._replay):
      if sock is not None and not sock.closed:
        sock.close(linger=0)
    if not self._ctx.closed:
      self._ctx.term()

  def _run(self) -> None:
    while not (self._stop.is_set() and self._queue.empty()):
      if self._replay is not None and self._replay.poll(0):
        self._serve_replay()
      try:
        seq, ts, events, rank = self._queue.get(timeout=0.1)
      except queue.Empty:
        continue
      payload = encode_batch(ts, events, rank, self.fmt)
      try:
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
      except zmq.ZMQError:  # the batch is lost (a gap), the stream goes on
        log.exception("KV event batch %d not sent", seq)
        continue
      self._replay_buffer.append((seq, payload))
      self.published_batches += 1

  def _serve_replay(self) -> None:
    """A replay request [identity, b"", start sequence number (8 bytes, big-endian)] gets
    every buffered batch from there as [seq, payload] frames, then [-1, b""]."""
    frames = self._replay.recv_multipart()
    if len(frames) != 3:
      log.warning("KV event replay request of %d frames ignored (3 expected)", len(frames))
      return
    client, _, start = frames
    first = int.from_bytes(start, "big")
    for seq, payload in list(self._replay_buffer):
      if seq >= first:
        self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
    self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


class KVEventRecorder(CacheListener):
  """One engine's events: collected on its thread as the allocator changes, handed to the
  publisher once per step (`flush`). `data_parallel_rank` names the engine among the
  process's replicas / workers."""

  def __init__(self, publisher: KVEventPublisher, *, block_size: int,
               data_parallel_rank: int = 0,
               lora_names: Callable[[int], str | None] | None = None):
    """`lora_names(lora_id)`: an adapter's name for `lora_name` (None: always nil)."""
    self.publisher, self.block_size = publisher, block_size
    self.data_parallel_rank = data_parallel_rank
    self.lora_names = lora_names
    self._pending: list[KVEvent] = []
    self._lora_of: dict[bytes, int] = {}  # cached hashes under an adapter -> its id

  def stored(self, page: int, h: bytes, parent: bytes | None, tokens: list[int]) -> None:
    """A page cached under `h`: extends the step's last BlockStored when it continues
    that chain, else starts one (`parent` a LoRA salt or None: a chain's first page)."""
    root = parent is None or _is_lora_salt(parent)
    lora = (int(parent[len(_LORA_SALT):]) if root and parent is not None
            else self._lora_of.get(parent))
    if lora is not None:
      self._lora_of[h] = lora
    last = self._pending[-1] if self._pending else None
    if (not root and isinstance(last, BlockStored) and last.block_hashes[-1] == parent
        and last.lora_id == lora):
      last.block_hashes.append(h)
      last.token_ids.extend(tokens)
      return
    name = None if lora is None or self.lora_names is None else self.lora_names(lora)
    self._pending.append(BlockStored(block_hashes=[h], parent_block_hash=None if root else parent,
                                     token_ids=list(tokens), block_size=self.block_size,
                                     lora_id=lora, lora_name=name))

  def evicted(self, page: int, h: bytes) -> None:
    """A cached page evicted: joins the step's last BlockRemoved if that is the last event."""
    self._lora_of.pop(h, None)
    last = self._pending[-1] if self._pending else None
    if isinstance(last, BlockRemoved):
      last.block_hashes.append(h)
    else:
      self._pending.append(BlockRemoved(block_hashes=[h]))

  def cleared(self) -> None:
    self._lora_of.clear()
    self._pending.append(AllBlocksCleared())

  def flush(self) -> None:
    """Publishes the events recorded since the last flush as one batch (none: nothing)."""
    if self._pending:
      events, self._pending = self._pending, []
      self.publisher.publish(events, self.data_parallel_rank)


def _is_lora_salt(parent: bytes) -> bool:
  """True for `Sequence.cache_salt` (b"lora:<id>"), the root of an adapter's chains; a
  16-byte digest could match only by a ~2^-90 chance."""
  return parent.startswith(_LORA_SALT) and parent[len(_LORA_SALT):].isdigit()
