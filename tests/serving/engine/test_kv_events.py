"""KV-cache events (serving/engine/kv_events.py): vLLM's wire shapes, the recorder, the
publisher's framing, replay and drops, and an engine's cache rebuilt from its events.

- Encoding: a batch decoded with plain msgpack is exactly what vLLM's msgspec
  structs give (positional arrays, or tagged maps), hashes as unsigned 64-bit
  integers of the digest's last 8 bytes.
- The recorder: one BlockStored per run of a chain, None as the parent of a
  chain's first page (LoRA salts included, their adapter as lora_id),
  evictions and clears in order.
- The publisher: [topic, 8-byte big-endian seq, payload] frames on a real
  SUB socket; replay from a sequence number; a full queue drops batches with
  a counter, never blocks, and leaves a gap in the sequence numbers.
- An engine (FakeRunner, a small pool, LoRA and base requests, evictions, a
  reset) whose cache a `CacheMirror` rebuilds from the replayed events alone.
"""

from __future__ import annotations

import msgpack
import pytest
import zmq
from frontend_fake import VOCAB, ByteTokenizer
from kv_event_sub import CacheMirror, replay
from server_procs import free_port, wait_until

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.engine.fake_runner import FakeRunner
from serving.engine.kv_events import (
  AllBlocksCleared,
  BlockRemoved,
  BlockStored,
  KVEventPublisher,
  KVEventRecorder,
  binds,
  encode_batch,
  wire_hash,
)
from serving.engine.page_allocator import PageAllocator, page_hash
from serving.types import SamplingParams

H1, H2, H3 = bytes(range(16)), bytes(range(16, 32)), bytes([0xff] * 16)


def test_wire_hash_is_the_last_eight_bytes_big_endian():
  assert wire_hash(H1) == 0x08090a0b0c0d0e0f
  assert wire_hash(H3) == 2**64 - 1  # unsigned: msgpack uint64, as vLLM's hashes
  assert msgpack.packb(wire_hash(H3))[0] == 0xcf


def test_array_batch_is_vllms_positional_msgspec_shape():
  events = [BlockStored([H1, H2], None, [1, 2, 3, 4], 2, None),
            BlockStored([H3], H2, [5, 6], 2, 7, lora_name="sql"), BlockRemoved([H1]),
            AllBlocksCleared()]
  got = msgpack.unpackb(encode_batch(12.5, events, 3, "array"))
  # msgspec, array_like=True, tag=True, omit_defaults: [tag, *fields] with vLLM 0.11's
  # BlockStored fields (no lora_name); the batch [ts, events, data_parallel_rank]
  assert got == [12.5, [
      ["BlockStored", [wire_hash(H1), wire_hash(H2)], None, [1, 2, 3, 4], 2, None, "GPU"],
      ["BlockStored", [wire_hash(H3)], wire_hash(H2), [5, 6], 2, 7, "GPU"],
      ["BlockRemoved", [wire_hash(H1)], "GPU"],
      ["AllBlocksCleared"]], 3]


def test_map_batch_is_vllms_tagged_map_shape():
  events = [BlockStored([H1], H2, [1, 2], 2, 5), BlockRemoved([H3]), AllBlocksCleared()]
  got = msgpack.unpackb(encode_batch(1.0, events, 0, "map"))
  assert got == [1.0, [
      {"type": "BlockStored", "block_hashes": [wire_hash(H1)],
       "parent_block_hash": wire_hash(H2), "token_ids": [1, 2], "block_size": 2, "lora_id": 5,
       "medium": "GPU", "lora_name": None},
      {"type": "BlockRemoved", "block_hashes": [wire_hash(H3)], "medium": "GPU"},
      {"type": "AllBlocksCleared"}], 0]
  assert list(got[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                             "block_size", "lora_id", "medium", "lora_name"]


def test_unknown_format_is_refused():
  with pytest.raises(ValueError, match="kv_events_format='json'"):
    encode_batch(0.0, [], 0, "json")


def test_bind_or_connect_follows_vllm():
  assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x")
  assert not binds("tcp://indexer:5557") and not binds("tcp://127.0.0.1:5557")


@pytest.fixture
def endpoints(tmp_path):
  return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


def batches(replay_endpoint: str, n: int) -> list[tuple[int, list]]:
  """The first `n` batches the publisher sent (waiting for its thread), decoded."""
  got: list = []

  def sent() -> bool:
    got[:] = replay(replay_endpoint)
    return len(got) >= n

  assert wait_until(sent, timeout_s=20)
  return [(seq, msgpack.unpackb(payload)) for seq, payload in got]


def test_recorder_batches_chains_roots_evictions_and_clears(endpoints):
  pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1])
  pub.start()
  try:
    alloc = PageAllocator(num_pages=5, page_size=2)  # 4 pages: one stays free
    rec = KVEventRecorder(pub, block_size=2, data_parallel_rank=1)
    alloc.listeners.append(rec)
    salt = b"lora:3"
    a = page_hash(None, [1, 2])
    b = page_hash(a, [3, 4])
    c = page_hash(salt, [1, 2])
    pages = alloc.allocate(3)
    alloc.commit(pages[0], a, None, [1, 2])
    alloc.commit(pages[1], b, a, [3, 4])
    alloc.commit(pages[2], c, salt, [1, 2])
    rec.flush()
    alloc.release(pages)
    alloc.allocate(3)  # 1 free page, then the LRU two cached ones: a, b
    rec.flush()
    alloc.clear_cache()
    rec.flush()
    rec.flush()  # nothing recorded: no batch
    got = batches(endpoints[1], 3)
  finally:
    pub.close()
  assert [seq for seq, _ in got] == [0, 1, 2]
  assert [rank for _, (_, _, rank) in got] == [1, 1, 1]
  assert [events for _, (_, events, _) in got] == [
      [["BlockStored", [wire_hash(a), wire_hash(b)], None, [1, 2, 3, 4], 2, None, "GPU"],
       ["BlockStored", [wire_hash(c)], None, [1, 2], 2, 3, "GPU"]],
      [["BlockRemoved", [wire_hash(a), wire_hash(b)], "GPU"]],
      [["AllBlocksCleared"]]]


def test_recorder_names_the_parent_of_a_continued_chain_and_its_adapter(endpoints):
  pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1])
  pub.start()
  try:
    alloc = PageAllocator(num_pages=4, page_size=1)
    rec = KVEventRecorder(pub, block_size=1)
    alloc.listeners.append(rec)
    a = page_hash(b"lora:12", [5])
    b = page_hash(a, [6])
    p = alloc.allocate(2)
    alloc.commit(p[0], a, b"lora:12", [5])
    rec.flush()
    alloc.commit(p[1], b, a, [6])  # a later step continues the chain
    rec.flush()
    got = batches(endpoints[1], 2)
  finally:
    pub.close()
  assert got[1][1][1] == [["BlockStored", [wire_hash(b)], wire_hash(a), [6], 1, 12, "GPU"]]


def test_frames_reach_a_subscriber(endpoints):
  pub = KVEventPublisher(endpoints[0], topic="kv@pod@m")
  pub.start()
  sub = zmq.Context.instance().socket(zmq.SUB)
  sub.setsockopt(zmq.LINGER, 0)
  sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
  sub.connect(endpoints[0])
  try:
    frames: list = []

    def received() -> bool:  # PUB drops until the subscription arrives: probe until then
      pub.publish([AllBlocksCleared()])
      if sub.poll(50):
        frames.append(sub.recv_multipart())
      return bool(frames)

    assert wait_until(received, timeout_s=20)
    topic, seq, payload = frames[0]
    assert topic == b"kv@pod@m" and len(seq) == 8
    first = int.from_bytes(seq, "big")
    pub.publish([BlockRemoved([H1])], data_parallel_rank=2)
    while True:  # the probes still in flight, then ours
      topic, seq, payload = sub.recv_multipart()
      ts, events, rank = msgpack.unpackb(payload)
      if events != [["AllBlocksCleared"]]:
        break
    assert int.from_bytes(seq, "big") > first
    assert (events, rank) == ([["BlockRemoved", [wire_hash(H1)], "GPU"]], 2)
  finally:
    sub.close()
    pub.close()


def test_full_queue_drops_with_a_counter_and_a_sequence_gap(endpoints):
  pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1], max_queue_batches=2)
  try:
    # Not started: nothing drains the queue, so the third batch finds it full.
    assert [pub.publish([AllBlocksCleared()]) for _ in range(3)] == [True, True, False]
    assert pub.dropped_batches == 1
    pub.start()
    assert wait_until(lambda: pub.published_batches == 2, timeout_s=20)
    assert pub.publish([BlockRemoved([H2])])
    got = batches(endpoints[1], 3)
  finally:
    pub.close()
  assert [seq for seq, _ in got] == [0, 1, 3]  # 2 was dropped: subscribers see the gap
  assert pub.published_batches == 3 and pub.dropped_batches == 1


def test_an_engines_stats_count_dropped_batches(endpoints):
  """A publisher that cannot keep up (here: never started) drops whole step batches;
  the engine's stats (and so /metrics' xlaserve_kv_events_dropped_total) count them."""
  engine = lora_engine(num_pages=20)
  pub = KVEventPublisher(endpoints[0], max_queue_batches=1)
  engine.attach_kv_events(KVEventRecorder(pub, block_size=PAGE))
  try:
    assert engine.stats().kv_events_dropped_total == 0
    run(engine, [(None, [1 + i] * 9) for i in range(3)])  # several steps commit pages
  finally:
    engine.shutdown()
  assert pub.dropped_batches > 0
  assert engine.stats().kv_events_dropped_total == pub.dropped_batches


def test_busy_port_raises_before_anything_is_sent(endpoints):
  busy = f"tcp://*:{free_port()}"
  first = KVEventPublisher(busy)
  try:
    with pytest.raises(zmq.ZMQError, match="in use"):
      KVEventPublisher(busy)
    with pytest.raises(zmq.ZMQError, match="in use"):  # the replay socket's port
      KVEventPublisher(endpoints[0], replay_endpoint=busy)
  finally:
    first.close()


PAGE = 4


def lora_engine(num_pages: int) -> LLMEngine:
  config = EngineConfig.of(max_num_seqs=3, max_model_len=64, page_size=PAGE, num_pages=num_pages,
                           max_num_batched_tokens=32, compilation_cache=False, max_loras=2)
  runner = FakeRunner(num_pages=num_pages, page_size=PAGE, max_num_seqs=3, vocab_size=VOCAB)
  return LLMEngine(runner=runner, tokenizer=ByteTokenizer(), config=config, model_name="base",
                   lora_loader=lambda path: (8, None))


def run(engine: LLMEngine, prompts: list[tuple[str | None, list[int]]]) -> None:
  params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
  for i, (lora, prompt) in enumerate(prompts):
    engine.add_request(f"r{i}-{len(prompt)}-{prompt[0]}", prompt, params, lambda out: None,
                       lora=lora)
  engine.run_until_idle()


def test_an_engines_cache_is_rebuilt_from_its_events(endpoints):
  engine = lora_engine(num_pages=20)  # 19 pages: the workload overflows them
  pub = KVEventPublisher(endpoints[0], replay_endpoint=endpoints[1], fmt="map")
  engine.attach_kv_events(KVEventRecorder(pub, block_size=PAGE, lora_names=engine.lora_name))
  pub.start()
  try:
    adapter = engine.load_lora("ad", "/ad")
    system = list(range(1, 17))  # four shared pages
    run(engine, [(None, system + [20 + i] * 9) for i in range(4)])
    run(engine, [("ad", system + [40 + i] * 7) for i in range(3)])
    run(engine, [(None, [60 + i] * 30) for i in range(3)])  # evicts older prefixes
    dropped = engine.reset_prefix_cache()
    run(engine, [(None, system + [80 + i] * 5) for i in range(2)] + [("ad", system + [90])])
    view = engine.prefix_cache_hashes()
    mirror = CacheMirror()

    def caught_up() -> bool:
      for seq, payload in replay(endpoints[1], mirror.last_seq + 1):
        mirror.apply(seq, payload)
      return mirror.blocks[0] == {wire_hash(h) for h in view[0]}

    assert wait_until(caught_up, timeout_s=20)
  finally:
    engine.shutdown()
  assert dropped > 0 and not mirror.errors
  assert mirror.counts["BlockRemoved"] > 0 and mirror.counts["AllBlocksCleared"] == 1
  assert len(view[0]) > 0
  root_base, root_lora = page_hash(None, system[:PAGE]), page_hash(b"lora:%d" % adapter.lora_id,
                                                                  system[:PAGE])
  assert mirror.lora_of[wire_hash(root_base)] is None
  assert mirror.lora_of[wire_hash(root_lora)] == adapter.lora_id
  assert mirror.lora_name_of[wire_hash(root_lora)] == "ad"
