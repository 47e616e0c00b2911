"""Load and faults against the real server (default model, one subprocess for the module).

Each test ends with every KV page free and nothing running or waiting, read
from `/metrics` (autouse `pages_free_after`). The module measures the
server's RSS after warm-up and checks it stays within a bound after the load
(`test_memory_flat`), and ends by draining it with SIGTERM.
The server runs `ops_faults.FaultInjectingEngine`: the real engine whose
output processing fails requests with a marked prompt (see ops_faults.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from ops_clients import (
  completion_body,
  grpc_generate,
  grpc_request,
  stream_completion,
)
from ops_faults import POISON_PREFIX
from ops_procs import REPO, OpsServer, assert_pages_free, idle_state, metrics, rss_bytes
from server_procs import DEFAULT_MODEL_TEST_CONFIG

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # soak and load against real servers

MAX_NUM_SEQS = DEFAULT_MODEL_TEST_CONFIG["max_num_seqs"]
QUEUE = 200  # --max_queued_requests: capacity is MAX_NUM_SEQS + QUEUE in-flight requests
CAPACITY = MAX_NUM_SEQS + QUEUE
SOAK_S = 60  # test_short_soak: seconds of load (the CI soak)
RSS_GROWTH_BOUND = 192 * 2**20  # bytes the server may grow by over the whole module
FIGURES: dict[str, object] = {}  # printed at the end (docs/reliability.md quotes them)


@pytest.fixture(scope="module")
def srv():
  s = OpsServer(f"--max_queued_requests={QUEUE}", "--drain_timeout_s=60",
                engine="ops_faults:faulty_engine")
  yield s
  s.kill()
  print(f"\nops load figures: {FIGURES}")


@pytest.fixture(autouse=True)
def pages_free_after(srv):
  yield
  assert_pages_free(srv)


def _client(srv, n: int = 16, timeout: float = 300) -> httpx.AsyncClient:
  limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
  return httpx.AsyncClient(base_url=srv.http, timeout=timeout, limits=limits)


def test_warm_up_and_rss_baseline(srv):
  async def warm():
    async with _client(srv) as c:
      res = await stream_completion(c, completion_body("Hello, my name is", 4))
      r = await c.post("/v1/completions", json=completion_body("Hi", 4, stream=False))
    async with grpc.aio.insecure_channel(srv.grpc) as ch:
      code, text, _ = await grpc_generate(pb_grpc.GenerationStub(ch), grpc_request("Hi", 4))
    return res, r, code, text

  res, r, code, text = asyncio.run(warm())
  assert res.done and res.text and r.status_code == 200
  assert code == grpc.StatusCode.OK and text
  FIGURES["rss_baseline_mib"] = round(rss_bytes(srv.pid) / 2**20, 1)


def test_200_concurrent_streams_30_percent_cancelled(srv):
  n, cancelled = 200, set(range(0, 200, 10)) | set(range(3, 200, 10)) | set(range(7, 200, 10))
  assert len(cancelled) == 60

  async def run():
    async with _client(srv, n=n + 8) as c:
      tasks = []
      for i in range(n):
        if i in cancelled:  # long enough to be cut mid-stream
          body = completion_body(f"Stream {i}: once upon a time", 24)
          tasks.append(stream_completion(c, body, cancel_after_chunks=1))
        else:
          tasks.append(stream_completion(c, completion_body(f"Stream {i}: the sky is", 2)))
      return await asyncio.gather(*tasks)

  start = time.monotonic()
  results = asyncio.run(run())
  FIGURES["200_streams_s"] = round(time.monotonic() - start, 1)
  for i, res in enumerate(results):
    assert res.status == 200, (i, res)
    if i in cancelled:
      assert res.chunks == 1 and not res.done, (i, res)
    else:
      assert res.done and res.finish_reason in ("length", "stop") and res.error is None, (i, res)
  m = metrics(srv.http)
  assert m["xlaserve_request_success_total"] >= n


def test_slow_readers_get_everything_and_do_not_stall_others(srv):
  body = completion_body("List the planets of the solar system:", 12)

  async def run():
    async with _client(srv) as c:
      slow = [stream_completion(c, body, read_delay_s=0.5) for _ in range(3)]
      fast = stream_completion(c, body)
      return await asyncio.gather(fast, *slow)

  fast, *slow = asyncio.run(run())
  assert fast.done and fast.text
  for res in slow:
    assert res.done and res.text == fast.text and res.finish_reason == fast.finish_reason
    assert res.seconds > fast.seconds  # the slow readers took longer; the fast one did not wait
  FIGURES["slow_reader_s"] = round(max(r.seconds for r in slow), 1)
  FIGURES["fast_reader_s"] = round(fast.seconds, 1)


def _raw_post_and_close(port: int, body: bytes) -> None:
  """Sends a whole HTTP request and closes the socket without reading a byte."""
  head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
          f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
  with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
    s.sendall(head + body)


def test_clients_that_leave_before_the_first_token(srv):
  for i in range(6):
    stream = i % 2 == 0
    body = json.dumps(completion_body(f"Gone {i}: tell me a long story", 64, stream=stream))
    _raw_post_and_close(srv.http_port, body.encode())

  async def run():
    async with _client(srv, timeout=0.05) as c:
      for i in range(4):  # the client times out (and closes) long before the first token
        with pytest.raises(httpx.TimeoutException):
          await c.post("/v1/completions", json=completion_body(f"Timeout {i}", 64, stream=False))
    async with grpc.aio.insecure_channel(srv.grpc) as ch:
      stub = pb_grpc.GenerationStub(ch)
      codes = []
      for i in range(4):  # cancelled at once, and deadlines far shorter than a prefill
        call = stub.Generate(grpc_request(f"Cancel {i}: a long story", 64))
        call.cancel()
        codes.append(await call.code())
        late = stub.Generate(grpc_request(f"Deadline {i}: a long story", 64), timeout=0.05)
        codes.append(await late.code())
      return codes

  codes = asyncio.run(run())
  assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
  assert httpx.get(f"{srv.http}/health", timeout=30).status_code == 200


def test_http_burst_beyond_capacity_gets_429_with_retry_after(srv):
  n = CAPACITY + 32

  async def run():
    admitted_all = asyncio.Event()
    statuses: list[tuple[int, str | None, dict]] = []

    async def one(c: httpx.AsyncClient, i: int) -> None:
      body = completion_body(f"Burst {i}: write an essay about rivers", 200)
      async with c.stream("POST", "/v1/completions", json=body) as r:
        err = (await r.aread()) if r.status_code != 200 else None
        statuses.append((r.status_code, r.headers.get("retry-after"), err))
        if len(statuses) == n:
          admitted_all.set()
        await admitted_all.wait()  # admitted streams stay open until every answer is in

    async with _client(srv, n=n + 8) as c:
      await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(n))), 240)
    return statuses

  statuses = asyncio.run(run())
  codes = [s for s, _, _ in statuses]
  rejected = [(ra, body) for s, ra, body in statuses if s == 429]
  assert set(codes) <= {200, 429}, codes
  # Admitted requests stay in flight until all answers are in, so exactly the overflow is refused
  # (a little more may pass if an admitted one finished early).
  assert n - CAPACITY - 4 <= len(rejected) <= n - CAPACITY, len(rejected)
  for retry_after, body in rejected:
    assert retry_after is not None and int(retry_after) >= 1
    assert b"rate_limit_exceeded" in body
  FIGURES["http_burst"] = {"sent": n, "200": codes.count(200), "429": len(rejected)}


def test_grpc_burst_beyond_capacity_gets_resource_exhausted(srv):
  n = CAPACITY + 32

  async def run():
    async with grpc.aio.insecure_channel(srv.grpc) as ch:
      stub = pb_grpc.GenerationStub(ch)
      calls = [stub.Generate(grpc_request(f"gBurst {i}: an essay about lakes", 200))
               for i in range(n)]
      deadline = time.monotonic() + 240
      while sum(c.done() for c in calls) < n - CAPACITY and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
      done = [c for c in calls if c.done()]
      results = [(await c.code(), dict(await c.trailing_metadata() or ())) for c in done]
      for c in calls:
        c.cancel()
      return results

  results = asyncio.run(run())
  assert len(results) >= n - CAPACITY
  exhausted = [md for code, md in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
  assert len(exhausted) >= n - CAPACITY - 4, [code for code, _ in results]
  assert all(int(md["retry-after"]) >= 1 for md in exhausted)
  FIGURES["grpc_burst"] = {"sent": n, "resource_exhausted": len(exhausted)}


def test_a_failing_request_fails_alone(srv):
  poisoned = POISON_PREFIX + [504, 1209, 2045]

  async def run():
    async with _client(srv) as c:
      good = [stream_completion(c, completion_body(f"Good {i}: the ocean is", 8))
              for i in range(3)]
      good.append(c.post("/v1/completions", json=completion_body("Good: rain", 8, stream=False)))
      bad = [stream_completion(c, completion_body(poisoned, 8)),
             c.post("/v1/completions", json=completion_body(poisoned, 8, stream=False))]
      async with grpc.aio.insecure_channel(srv.grpc) as ch:
        bad.append(grpc_generate(pb_grpc.GenerationStub(ch), grpc_request(poisoned, 8)))
        return await asyncio.gather(asyncio.gather(*good), asyncio.gather(*bad))

  good, (bad_stream, bad_json, bad_grpc) = asyncio.run(run())
  *good_streams, good_json = good
  for res in good_streams:
    assert res.done and res.error is None and res.finish_reason == "length", res
  assert good_json.status_code == 200 and good_json.json()["choices"][0]["finish_reason"]
  assert bad_stream.error is not None and "injected fault" in bad_stream.error["message"]
  assert bad_stream.done  # the stream still ends cleanly
  assert bad_json.status_code == 500 and "injected fault" in bad_json.json()["error"]["message"]
  assert bad_grpc[0] == grpc.StatusCode.INTERNAL and "injected fault" in bad_grpc[1]
  assert metrics(srv.http)["xlaserve_request_success_total"] > 0
  assert httpx.get(f"{srv.http}/health", timeout=30).status_code == 200


def test_short_soak(srv, tmp_path):
  """benchmarks/soak.py, attached to this server for 60 s (the CI variant of the soak)."""
  out = tmp_path / "soak.json"
  cmd = [sys.executable, os.path.join(REPO, "benchmarks", "soak.py"), f"--url={srv.http}",
         f"--pid={srv.pid}", f"--duration_s={SOAK_S}", "--concurrency=4", "--min_tokens=2",
         "--max_tokens=8", "--sample_s=3", "--max_latency_drift=4", f"--output={out}"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SOAK_S + 210, cwd=REPO)
  assert out.exists(), proc.stdout + proc.stderr
  report = json.loads(out.read_text())
  FIGURES[f"soak_{SOAK_S}s"] = {k: report[k] for k in ("requests", "errors", "latency_drift",
                                                        "rss_drift_mib", "pages_in_use_end")}
  assert report["errors"] == 0 and report["pages_in_use_end"] == 0, report
  assert report["requests"] >= SOAK_S // 8 and report["passed"], report
  assert proc.returncode == 0, proc.stderr


def test_memory_flat(srv):
  rss = rss_bytes(srv.pid)
  FIGURES["rss_after_load_mib"] = round(rss / 2**20, 1)
  growth = rss - FIGURES["rss_baseline_mib"] * 2**20
  assert growth < RSS_GROWTH_BOUND, f"RSS grew by {growth / 2**20:.0f} MiB"


def test_sigterm_drains_in_flight_then_exits_0(srv):
  """Last test of the module: it stops the server."""

  async def run():
    async with _client(srv) as c:
      first = asyncio.Event()
      started = 0

      async def one(i: int):
        nonlocal started
        async with c.stream("POST", "/v1/completions",
                            json=completion_body(f"Drain {i}: a story about", 16)) as r:
          assert r.status_code == 200
          text, done, finish, counted = "", False, None, False
          async for line in r.aiter_lines():
            if line == "data: [DONE]":
              done = True
            elif line.startswith("data: "):
              choice = json.loads(line[6:])["choices"][0]
              text += choice["text"]
              finish = choice["finish_reason"] or finish
              if text and not counted:
                counted = True
                started += 1
                if started == 3:
                  first.set()
          return text, done, finish

      tasks = [asyncio.create_task(one(i)) for i in range(3)]
      await asyncio.wait_for(first.wait(), 120)
      sent = time.monotonic()
      srv.proc.send_signal(signal.SIGTERM)
      await asyncio.sleep(0.5)
      try:  # no new work during the drain: 503 or a refused connection
        r = await c.post("/v1/completions", json=completion_body("late", 4, stream=False))
        assert r.status_code == 503
      except httpx.TransportError:
        pass
      results = await asyncio.gather(*tasks)
      return results, sent

  assert idle_state(srv.http) == (0.0, 0.0, 0.0)
  results, sent = asyncio.run(run())
  for text, done, finish in results:
    assert done and text and finish == "length"
  code = srv.proc.wait(90)
  FIGURES["drain_exit_s"] = round(time.monotonic() - sent, 1)
  assert code == 0, srv.output()
  assert "drained" in srv.output()
