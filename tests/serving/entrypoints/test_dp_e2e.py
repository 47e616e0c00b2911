"""`xlaserve serve --dp=2`: two engine replicas behind one HTTP server, end to end.

The launcher runs on 2 simulated CPU devices with a tiny Llama. Eight
concurrent greedy completions return what one in-process engine (dp = 1)
returns for the same prompts; the server's /metrics show each replica's own
series, both of which served requests; the health endpoint is green.
"""

import asyncio

import httpx
import pytest
from server_procs import ServerProcess, engine_flags, subprocess_env, xla_flags

from tiny_models import greedy_alone, save_tiny_model

pytestmark = pytest.mark.slow  # real servers over replicas

ENGINE = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=48,
              max_num_batched_tokens=64, prefill_buckets=(64,), decode_buckets=(4,),
              unroll_layers=False)
PROMPTS = [f"request {i}: the quick brown fox" for i in range(8)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tiny_dp"))
  save_tiny_model("llama", path)
  return path


def _flags(path: str) -> list[str]:
  return [f"--model={path}", "--dp=2", *engine_flags(ENGINE)]


async def _complete(url: str) -> list[str]:
  async with httpx.AsyncClient(base_url=url, timeout=120) as c:
    rs = await asyncio.gather(*(c.post("/v1/completions", json={
        "model": "m", "prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        for p in PROMPTS))
  assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
  return [r.json()["choices"][0]["text"] for r in rs]


def test_two_replicas_serve_like_one_engine(tiny_dir):
  alone = greedy_alone(tiny_dir, ENGINE, PROMPTS, 6)
  expected = [alone[p][0] for p in PROMPTS]
  env = subprocess_env(XLA_FLAGS=xla_flags(2))
  server = ServerProcess(*_flags(tiny_dir), "--served_model_name=m", env=env,
                         start_timeout_s=180)
  try:
    assert "replica 1 of 2" in server.output()
    assert asyncio.run(_complete(server.http)) == expected
    assert httpx.get(server.http + "/health", timeout=10).status_code == 200
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.http + "/metrics", timeout=10).text
    generated = {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name == "xlaserve_generation_tokens_total"}
    assert set(generated) == {"0", "1"} and all(v > 0 for v in generated.values())
    assert sum(generated.values()) == 6 * len(PROMPTS)
  finally:
    assert server.terminate() == 0
