"""`xlaserve serve --kv_events_endpoint`: a router's view of the prefix cache, end to end.

A real server process (tiny Llama, a 23-page KV pool) publishes its KV-cache
events to a pyzmq SUB socket that binds, as llm-d's centralized indexer does
(the server connects: `tcp://127.0.0.1:PORT`). A mixed workload — concurrent
requests sharing a system prompt (one streaming), prompts that overflow the
pool and evict cached prefixes, `POST /reset_prefix_cache`, then more shared
and fresh prompts — runs over HTTP. The set of block hashes rebuilt from the
events alone equals the server's own view (`GET /debug/prefix_cache`); the
events were consistent all along (no store of a held hash, no removal of an
unknown one, no gap in the sequence numbers) and include evictions and the clear.
"""

import asyncio
import queue
import threading

import httpx
import pytest
import zmq
from kv_event_sub import CacheMirror
from server_procs import ServerProcess, engine_flags, free_port, subprocess_env, wait_until

from tiny_models import save_tiny_model

pytestmark = pytest.mark.slow  # a real server

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=24,
              max_num_batched_tokens=64, prefill_buckets="64", decode_buckets="4",
              unroll_layers=False)
TOPIC = "kv@pod-0@m"
SYSTEM = [(7 * i) % 250 + 1 for i in range(24)]  # three shared pages


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_kv_events"))
  save_tiny_model("llama", path)
  return path


async def _complete(url: str, prompts: list[list[int]], stream_first: bool = False) -> None:
  async with httpx.AsyncClient(base_url=url, timeout=300) as c:
    async def one(i: int, prompt: list[int]) -> None:
      body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
              "ignore_eos": True, "stream": stream_first and i == 0}
      r = await c.post("/v1/completions", json=body)
      assert r.status_code == 200, r.text
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def _subscribe(port: int, out: queue.Queue, stop: threading.Event,
               listening: threading.Event) -> None:
  """A subscriber's loop, as llm-d's: bind, then poll and receive until stopped (a SUB
  socket sends its subscription to a connecting publisher only while it is polled)."""
  sub = zmq.Context.instance().socket(zmq.SUB)
  sub.setsockopt(zmq.LINGER, 0)
  sub.setsockopt(zmq.RCVHWM, 0)  # keep every batch until the test reads it
  sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
  sub.bind(f"tcp://127.0.0.1:{port}")
  listening.set()
  try:
    while not stop.is_set():
      if sub.poll(50):
        out.put(sub.recv_multipart())
  finally:
    sub.close()


def _check_view(url: str, mirror: CacheMirror, drain) -> set[int]:
  """The server's view of its prefix cache, once the mirror (fed by `drain`) equals it."""
  view = httpx.get(f"{url}/debug/prefix_cache", timeout=60).json()["engines"]
  assert [e["data_parallel_rank"] for e in view] == [0]
  expected = set(view[0]["block_hashes"])

  def caught_up() -> bool:
    drain()
    return mirror.blocks[0] == expected

  assert wait_until(caught_up, timeout_s=60), (len(mirror.blocks[0]), len(expected))
  return expected


def test_subscriber_rebuilds_the_prefix_cache_from_events(tiny_dir):
  port = free_port()
  received: queue.Queue = queue.Queue()
  stop = threading.Event()
  listening = threading.Event()
  reader = threading.Thread(target=_subscribe, args=(port, received, stop, listening))
  reader.start()
  assert listening.wait(30)
  mirror = CacheMirror()

  def drain() -> None:
    while not received.empty():
      frames = received.get()
      assert frames[0] == TOPIC.encode()
      mirror.receive(frames)

  server = ServerProcess(f"--model={tiny_dir}", "--served_model_name=m",
                         *engine_flags(ENGINE), f"--kv_events_endpoint=tcp://127.0.0.1:{port}",
                         f"--kv_events_topic={TOPIC}", env=subprocess_env(),
                         start_timeout_s=300)
  try:
    url = server.http
    asyncio.run(_complete(url, [SYSTEM + [200 + i] * 10 for i in range(4)], stream_first=True))
    for i in range(3):  # 6 pages each, two at a time: the pool overflows, prefixes are evicted
      asyncio.run(_complete(url, [[(31 * i + 5 * j + k) % 250 + 1 for k in range(40)]
                                  for j in range(2)]))
      drain()
    before_reset = _check_view(url, mirror, drain)
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 200
    asyncio.run(_complete(url, [SYSTEM + [210 + i] * 12 for i in range(3)] + [[9] * 30]))
    expected = _check_view(url, mirror, drain)
  finally:
    stop.set()
    reader.join()
    assert server.terminate() == 0, server.output()
  assert not mirror.errors, mirror.errors[:5]
  assert mirror.counts["BlockRemoved"] > 0 and mirror.counts["AllBlocksCleared"] == 1
  assert len(before_reset) >= 10 and len(expected) >= 3  # the shared prompt's pages again
