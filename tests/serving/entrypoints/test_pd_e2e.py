"""`xlaserve serve --prefill_workers=1 --decode_workers=1`: a 1P+1D pair, end to end.

The launcher serves a tiny Llama with one prefill and one decode worker
sharing the CPU device (tests/pd_faults.py wraps the prefill worker's runner
so the test can kill it later). Checked over the running server:
- greedy completions over HTTP (8 at once) and gRPC `Generate` return what
  one in-process engine returns, token for token;
- /metrics has both roles; after the completions, and after a stream the
  client drops mid-generation, every KV page of both workers is free again;
- the prefill worker killed in the middle of a transfer fails that request
  alone (HTTP 500 naming the prefill worker), the decode worker's pages are
  all free, /health stays green and the next requests are served correctly
  (the decode worker prefills them itself).
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from server_procs import ServerProcess, engine_flags, metric_value, subprocess_env, wait_until

from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2 as pb
from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2_grpc as pb_grpc
from tiny_models import greedy_alone, save_tiny_model

pytestmark = pytest.mark.slow  # real servers over prefill / decode workers

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=48,
              max_num_batched_tokens=64, prefill_buckets=(64,), decode_buckets=(4,),
              unroll_layers=False, kv_transfer_pages=2)
PROMPTS = [f"request {i}: the quick brown fox" + " jumps" * (i % 3) for i in range(8)]
LONG = "a prompt that takes several transfer chunks"  # 5 full pages: 3 chunks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_pd_e2e"))
  save_tiny_model("llama", path)
  return path


@pytest.fixture(scope="module")
def expected(tiny_dir):
  return greedy_alone(tiny_dir, ENGINE, [*PROMPTS, LONG], 6)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
  kill_file = tmp_path_factory.mktemp("kill") / "now"
  flags = [f"--model={tiny_dir}", "--prefill_workers=1", "--decode_workers=1",
           "--served_model_name=m", *engine_flags(ENGINE)]
  srv = ServerProcess(*flags, env=subprocess_env(XLASERVE_TEST_KILL_FILE=str(kill_file)),
                      start_timeout_s=180, engine="pd_faults:killable_prefill_engine")
  srv.kill_file = kill_file
  yield srv
  assert srv.terminate() == 0, srv.output()


async def _complete(url: str, prompts: list[str]) -> list[httpx.Response]:
  async with httpx.AsyncClient(base_url=url, timeout=120) as c:
    return await asyncio.gather(*(c.post("/v1/completions", json={
        "model": "m", "prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        for p in prompts))


def _all_pages_free(url: str, role: str) -> bool:
  total = metric_value(url, "xlaserve_kv_cache_pages_total", role=role)
  return total > 0 and metric_value(url, "xlaserve_kv_cache_pages_free", role=role) == total


def test_http_and_grpc_match_one_engine(server, expected):
  assert "prefill worker 0" in server.output() and "decode worker 0" in server.output()
  rs = asyncio.run(_complete(server.http, PROMPTS))
  assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
  assert [r.json()["choices"][0]["text"] for r in rs] == [expected[p][0] for p in PROMPTS]
  with grpc.insecure_channel(server.grpc) as ch:
    stub = pb_grpc.GenerationStub(ch)
    for p in PROMPTS[:3]:
      msgs = list(stub.Generate(pb.GenerateRequest(text=p, sampling=pb.SamplingParams(
          max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=120))
      assert [t for m in msgs for t in m.token_ids] == expected[p][1]
  assert metric_value(server.http, "xlaserve_prompt_tokens_total", role="prefill") > 0
  assert metric_value(server.http, "xlaserve_generation_tokens_total", role="decode") > 0
  assert metric_value(server.http, "xlaserve_kv_transfers_total") == len(PROMPTS) + 3
  assert metric_value(server.http, "xlaserve_kv_transfer_pages_total") > len(PROMPTS)
  for role in ("prefill", "decode"):
    assert wait_until(lambda role=role: _all_pages_free(server.http, role), 30), role


def test_dropped_stream_frees_both_sides(server):
  with httpx.stream("POST", server.http + "/v1/completions", json={
      "model": "m", "prompt": LONG, "max_tokens": 40, "ignore_eos": True, "stream": True},
      timeout=120) as r:
    assert r.status_code == 200
    chunks = 0
    for line in r.iter_lines():
      chunks += line.startswith("data:")
      if chunks >= 3:
        break  # the client goes away mid-generation
  for role in ("prefill", "decode"):
    assert wait_until(lambda role=role: _all_pages_free(server.http, role), 30), role


def test_prefill_worker_killed_mid_transfer(server, expected):
  server.kill_file.touch()
  r = asyncio.run(_complete(server.http, [LONG]))[0]
  assert r.status_code == 500 and "prefill worker" in r.text, r.text
  assert metric_value(server.http, "xlaserve_kv_transfer_failures_total") == 1
  assert wait_until(lambda: _all_pages_free(server.http, "decode"), 30)
  assert httpx.get(server.http + "/health", timeout=10).status_code == 200
  rs = asyncio.run(_complete(server.http, [LONG, PROMPTS[1]]))
  assert [r.json()["choices"][0]["text"] for r in rs] == [expected[LONG][0],
                                                          expected[PROMPTS[1]][0]]
  assert wait_until(lambda: _all_pages_free(server.http, "decode"), 30)
