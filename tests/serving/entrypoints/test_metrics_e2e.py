"""/metrics on the real server, checked against what a short concurrent load sent."""

import asyncio

import httpx
import pytest
from frontend_procs import metric_value, shared_real_server

pytestmark = pytest.mark.slow  # a real server on the default model

MODEL = "smollm2-135m-instruct"
COUNTED = ["xlaserve_prompt_tokens_total", "xlaserve_generation_tokens_total",
           "xlaserve_e2e_request_latency_seconds_count",
           "xlaserve_time_to_first_token_seconds_count",
           "xlaserve_inter_token_latency_seconds_count"]


@pytest.fixture(scope="module")
def srv(request):
  return shared_real_server(request)


async def _load(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
  async with httpx.AsyncClient(base_url=url, timeout=300) as c:
    rs = await asyncio.gather(*(c.post("/v1/completions", json={
        "model": MODEL, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0}) for p in prompts))
  assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
  return [r.json() for r in rs]


def test_counters_match_the_load(srv):
  url = srv.http
  before = {name: metric_value(url, name) for name in COUNTED}
  length_before = metric_value(url, "xlaserve_request_success_total", finish_reason="length")
  prompts = ["One", "Two words", "Three words here"]
  bodies = asyncio.run(_load(url, prompts, max_tokens=3))
  delta = {name: metric_value(url, name) - before[name] for name in COUNTED}
  assert delta["xlaserve_prompt_tokens_total"] == sum(b["usage"]["prompt_tokens"] for b in bodies)
  assert delta["xlaserve_generation_tokens_total"] == 3 * len(prompts)
  assert delta["xlaserve_e2e_request_latency_seconds_count"] == len(prompts)
  assert delta["xlaserve_time_to_first_token_seconds_count"] == len(prompts)
  assert delta["xlaserve_inter_token_latency_seconds_count"] == 2 * len(prompts)
  assert metric_value(url, "xlaserve_request_success_total",
                      finish_reason="length") == length_before + len(prompts)
  assert metric_value(url, "xlaserve_num_requests_running") == 0
  assert metric_value(url, "xlaserve_prefix_cache_queries_total") >= metric_value(
      url, "xlaserve_prefix_cache_hits_total")
