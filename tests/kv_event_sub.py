"""A KV event subscriber for tests: decodes vLLM-format batches and mirrors the cache.

`CacheMirror` is what a router keeps (llm-d's indexer, reduced to sets): per
`data_parallel_rank`, the block hashes cached now, rebuilt from the events
alone. It decodes both event shapes (positional arrays and tagged maps) the way
consumers do, and records every inconsistency it sees (a store of a hash it
holds, a removal of one it does not, a gap in the sequence numbers) in
`errors`, so tests assert on those too.
`replay(endpoint, start)` asks a publisher's replay socket for its buffered batches.
"""

from __future__ import annotations

import collections

import msgpack
import zmq


def event_fields(event) -> tuple[str, dict]:
  """(tag, {field: value}) of one decoded event, array- or map-shaped."""
  if isinstance(event, dict):
    event = dict(event)
    return event.pop("type"), event
  names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name"),  # later fields may be absent
           "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}[event[0]]
  return event[0], dict(zip(names, event[1:], strict=False))


class CacheMirror:
  """The cached block hashes per rank, from events alone (see module doc)."""

  def __init__(self):
    self.blocks: dict[int, set[int]] = collections.defaultdict(set)
    self.lora_of: dict[int, int | None] = {}  # every hash ever stored -> its lora_id
    self.lora_name_of: dict[int, str | None] = {}  # ... and its lora_name
    self.counts: collections.Counter[str] = collections.Counter()
    self.errors: list[str] = []
    self.last_seq = -1

  def receive(self, frames: list[bytes]) -> None:
    """One multipart message [topic, seq, payload] off the PUB socket."""
    _, seq_bytes, payload = frames
    self.apply(int.from_bytes(seq_bytes, "big"), payload)

  def apply(self, seq: int, payload: bytes) -> None:
    """One batch, in sequence-number order."""
    if seq != self.last_seq + 1:
      self.errors.append(f"batch {seq} after {self.last_seq}")
    self.last_seq = seq
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    for event in events:
      tag, fields = event_fields(event)
      self.counts[tag] += 1
      held = self.blocks[rank]
      if tag == "BlockStored":
        n = len(fields["block_hashes"])
        if len(fields["token_ids"]) != n * fields["block_size"]:
          self.errors.append(f"{n} blocks with {len(fields['token_ids'])} tokens")
        for h in fields["block_hashes"]:
          if h in held:
            self.errors.append(f"stored {h} twice")
          held.add(h)
          self.lora_of[h] = fields["lora_id"]
          self.lora_name_of[h] = fields.get("lora_name")
      elif tag == "BlockRemoved":
        for h in fields["block_hashes"]:
          if h not in held:
            self.errors.append(f"removed {h}, not held")
          held.discard(h)
      else:
        held.clear()


def replay(endpoint: str, start: int = 0, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
  """The (seq, payload) batches a publisher's replay socket holds from `start` on."""
  ctx = zmq.Context.instance()
  sock = ctx.socket(zmq.DEALER)
  sock.setsockopt(zmq.LINGER, 0)
  sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
  try:
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
      _, seq_bytes, payload = sock.recv_multipart()
      seq = int.from_bytes(seq_bytes, "big", signed=True)
      if seq == -1:
        return out
      out.append((seq, payload))
  finally:
    sock.close()
