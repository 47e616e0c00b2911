"""Prefill / decode across processes: `--kv_role=prefill`, two `--kv_role=decode` servers
and the reference proxy (serving/tools/pd_proxy.py), all on loopback.

A tiny Llama on every server. Checked over real HTTP:
- 32 concurrent greedy completions through the proxy, half streamed, return
  what one in-process engine returns; both decode servers pulled pages and
  computed none of the pulled tokens (queued requests keep theirs); once
  idle, no KV page is in use on any server and no offer is pending;
- a decode leg whose kv_transfer_params name no live offer still succeeds
  (the decode server prefills it);
- the prefill server killed (SIGKILL) while an offer is pinned: all 32
  requests still complete correctly (the proxy or the decode servers prefill
  them), the decode servers have no page in use and /health stays 200.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_procs import (
  REPO,
  ServerProcess,
  engine_flags,
  free_port,
  metric_value,
  subprocess_env,
  wait_until,
)

from tiny_models import greedy_alone, save_tiny_model

pytestmark = pytest.mark.slow  # four real processes

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=96,
              max_num_batched_tokens=64, prefill_buckets=(64,), decode_buckets=(4,),
              unroll_layers=False, kv_transfer_pages=1)
PROMPTS = [f"request {i}: the quick brown fox" + " jumps over the dog" * (i % 4)
           for i in range(32)]
MAX_TOKENS = 6


def _flags(tiny_dir: str) -> list[str]:
  return [f"--model={tiny_dir}", "--served_model_name=m", "--grpc_port=-1",
          *engine_flags(ENGINE)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_pd_processes"))
  save_tiny_model("llama", path)
  return path


@pytest.fixture(scope="module")
def expected(tiny_dir):
  return {p: text for p, (text, _) in greedy_alone(tiny_dir, ENGINE, PROMPTS, MAX_TOKENS).items()}


class ProxyProcess:
  """`python -m serving.tools.pd_proxy` on a free port."""

  def __init__(self, prefill: list[str], decode: list[str]):
    self.port = free_port()
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "serving.tools.pd_proxy", f"--port={self.port}",
         f"--prefill={','.join(prefill)}", f"--decode={','.join(decode)}"],
        env=subprocess_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    line = self.proc.stdout.readline()
    assert line.startswith("pd_proxy ready"), line
    threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep the pipe free

  @property
  def http(self) -> str:
    return f"http://127.0.0.1:{self.port}"

  def stop(self) -> None:
    self.proc.terminate()
    self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_dir):
  flags = _flags(tiny_dir)
  prefill = ServerProcess(*flags, "--kv_role=prefill", "--kv_transfer_timeout_s=20",
                          start_timeout_s=240)
  decode = [ServerProcess(*flags, "--kv_role=decode", "--kv_transfer_timeout_s=20",
                          start_timeout_s=240) for _ in range(2)]
  proxy = ProxyProcess([prefill.http], [d.http for d in decode])
  yield prefill, decode, proxy
  proxy.stop()
  for d in decode:
    assert d.terminate() == 0, d.output()
  prefill.kill()


async def _one(c: httpx.AsyncClient, prompt: str, stream: bool) -> str:
  body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
          "ignore_eos": True, "stream": stream}
  if not stream:
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]
  text = ""
  async with c.stream("POST", "/v1/completions", json=body) as r:
    assert r.status_code == 200, await r.aread()
    async for line in r.aiter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        text += chunk["choices"][0]["text"]
  return text


async def _all(url: str, prompts: list[str]) -> list[str]:
  async with httpx.AsyncClient(base_url=url, timeout=300) as c:
    return await asyncio.gather(*(_one(c, p, i % 2 == 1) for i, p in enumerate(prompts)))


def _stats(url: str) -> dict:
  return httpx.get(f"{url}/v1/kv_transfer/stats", timeout=10).json()


def _idle(url: str) -> bool:
  return metric_value(url, "xlaserve_kv_cache_usage_perc") == 0.0


def test_proxy_output_matches_one_server(cluster, expected):
  prefill, decode, proxy = cluster
  got = asyncio.run(_all(proxy.http, PROMPTS))
  assert got == [expected[p] for p in PROMPTS]
  stats = [_stats(d.http) for d in decode]
  assert all(s["pulls_total"] > 0 for s in stats)
  assert sum(s["pull_failures_total"] for s in stats) == 0
  # Every pulled page was used: the decode servers computed none of those tokens.
  pulled = sum(s["pages_total"] for s in stats) * ENGINE["page_size"]
  prompt = sum(metric_value(d.http, "xlaserve_prompt_tokens_total") for d in decode)
  computed = sum(metric_value(d.http, "xlaserve_prefill_tokens_computed_total") for d in decode)
  assert pulled > prompt / 2 and computed <= prompt - pulled
  for srv in (prefill, *decode):
    assert wait_until(lambda srv=srv: _idle(srv.http), 20), srv.output()
  assert _stats(prefill.http)["pending_offers"] == 0


def test_stale_params_fall_back_to_local_prefill(cluster, expected):
  prefill, decode, _ = cluster
  params = {"do_remote_prefill": True, "remote_engine_id": _stats(prefill.http)["engine_id"],
            "remote_request_id": "no-such-offer", "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1", "remote_port": prefill.http_port}
  r = httpx.post(f"{decode[0].http}/v1/completions", timeout=120, json={
      "model": "m", "prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0.0,
      "ignore_eos": True, "kv_transfer_params": params})
  assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[PROMPTS[3]]
  bad = httpx.post(f"{decode[0].http}/v1/completions", timeout=30, json={
      "model": "m", "prompt": "x", "kv_transfer_params": {**params, "remote_port": "1"}})
  assert bad.status_code == 400
  assert wait_until(lambda: _idle(decode[0].http), 20)


def test_prefill_server_killed_mid_transfer(cluster, expected):
  prefill, decode, proxy = cluster
  killed_with_pending = []

  def killer() -> None:
    deadline = time.monotonic() + 120
    base = _stats(prefill.http)["chunks_total"]
    while time.monotonic() < deadline:
      s = _stats(prefill.http)
      if s["chunks_total"] > base and s["pending_offers"] > 0:
        prefill.kill()
        killed_with_pending.append(s["pending_offers"])
        return
      time.sleep(0.01)

  thread = threading.Thread(target=killer)
  thread.start()
  got = asyncio.run(_all(proxy.http, PROMPTS))
  thread.join()
  assert killed_with_pending, "the prefill server was not killed during a transfer"
  assert got == [expected[p] for p in PROMPTS]
  for d in decode:
    assert httpx.get(f"{d.http}/health", timeout=10).status_code == 200
    assert wait_until(lambda d=d: _idle(d.http), 20), d.output()
