"""AsyncEngine, the asyncio bridge under the HTTP / gRPC / batch front ends (the fake engine)."""

import asyncio
import contextlib

import pytest
from frontend_fake import fake_engine

from serving.entrypoints.async_engine import AsyncEngine, ServerBusyError, ServerDrainingError
from serving.entrypoints.metrics import Metrics
from serving.types import SamplingParams


def _idle(engine) -> bool:
  s = engine.stats()
  return s.num_running == 0 and s.num_waiting == 0 and s.num_pages_free == s.num_pages_total


async def _until(cond, timeout: float = 2.0) -> bool:
  for _ in range(int(timeout / 0.01)):
    if cond():
      return True
    await asyncio.sleep(0.01)
  return cond()


@pytest.fixture
def engine():
  e = fake_engine(max_num_seqs=2, max_model_len=256, num_pages=32, step_s=0.01)
  e.start()
  yield e
  e.shutdown()


def test_generate_yields_deltas(engine):
  async def main():
    ae = AsyncEngine(engine)
    outs = [o async for o in ae.generate("abc", SamplingParams(max_tokens=5))]
    assert "".join(o.text for o in outs) == "abcab"
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert ae.num_inflight == 0

  asyncio.run(main())


def test_cancelling_the_consumer_aborts(engine):
  async def main():
    metrics = Metrics(engine.stats)
    ae = AsyncEngine(engine, metrics=metrics)

    async def consume():
      async for _ in ae.generate("ab", SamplingParams(max_tokens=200)):
        pass

    task = asyncio.create_task(consume())
    assert await _until(lambda: engine.stats().num_running == 1)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
      await task
    assert await _until(lambda: _idle(engine), 0.5)  # 200 tokens would take 2 s
    assert ae.num_inflight == 0
    assert metrics.request_success.labels(model_name="", finish_reason="abort")._value.get() == 1

  asyncio.run(main())


def test_leaving_the_loop_early_aborts(engine):
  async def main():
    ae = AsyncEngine(engine)
    gen = ae.generate("ab", SamplingParams(max_tokens=200))
    async for _ in gen:
      break
    await gen.aclose()
    assert await _until(lambda: _idle(engine), 0.5)

  asyncio.run(main())


def test_admission_errors(engine):
  async def main():
    ae = AsyncEngine(engine, max_queued_requests=1)  # 2 slots + 1 queued
    with pytest.raises(ValueError, match="empty"):
      ae.submit([], SamplingParams(max_tokens=1))
    assert ae.num_inflight == 0
    streams = [ae.submit("ab", SamplingParams(max_tokens=200)) for _ in range(3)]
    with pytest.raises(ServerBusyError):
      ae.submit("ab", SamplingParams(max_tokens=1))
    assert ae.num_inflight == 3
    ae.stop_accepting()
    with pytest.raises(ServerDrainingError):
      ae.submit("ab", SamplingParams(max_tokens=1))
    assert not await ae.wait_idle(0.05)
    ae.abort_all()
    assert await ae.wait_idle(1.0)
    assert all(s.closed for s in streams)
    assert await _until(lambda: _idle(engine), 0.5)

  asyncio.run(main())
