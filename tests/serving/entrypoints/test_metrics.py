"""Prometheus metrics: names, per-server registries, latency math, counters vs. a known load."""

import httpx
import pytest
from frontend_fake import InProcessServer, fake_engine
from frontend_procs import metric_value
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving.entrypoints import metrics as metrics_lib
from serving.entrypoints.metrics import Metrics
from serving.types import EngineStats, SpecDecodeCounters

REQUIRED = [
    "xlaserve_num_requests_running", "xlaserve_num_requests_waiting",
    "xlaserve_kv_cache_usage_perc", "xlaserve_num_preemptions_total",
    "xlaserve_prompt_tokens_total", "xlaserve_generation_tokens_total",
    "xlaserve_prefix_cache_queries_total", "xlaserve_prefix_cache_hits_total",
    "xlaserve_request_success_total", "xlaserve_time_to_first_token_seconds",
    "xlaserve_time_per_output_token_seconds", "xlaserve_inter_token_latency_seconds",
    "xlaserve_e2e_request_latency_seconds",
]


def _samples(text: str) -> dict[str, float]:
  out = {}
  for family in text_string_to_metric_families(text):
    for s in family.samples:
      out[s.name] = out.get(s.name, 0.0) + s.value
  return out


def test_replicas_get_one_series_each():
  """dp replicas (serving/engine/replicas.py): every engine metric per replica, labelled."""
  def stats(running, generated):
    return EngineStats(num_running=running, num_waiting=0, kv_cache_usage=0.5, num_pages_total=8,
                       num_pages_free=4, num_preemptions_total=0, prompt_tokens_total=10,
                       generation_tokens_total=generated, prefix_cache_queries_total=0,
                       prefix_cache_hits_total=0, prefill_tokens_computed_total=10,
                       spec_decode=SpecDecodeCounters(accepted_per_pos=[1]))
  parts = [stats(3, 30), stats(1, 12)]
  m = Metrics(lambda: None, model_name="m", replica_stats_fn=lambda: parts)
  by_replica = {}
  for family in text_string_to_metric_families(m.render()[0].decode()):
    for sample in family.samples:
      if "replica" in sample.labels:
        by_replica[(sample.name, sample.labels["replica"])] = sample.value
  assert by_replica[("xlaserve_num_requests_running", "0")] == 3
  assert by_replica[("xlaserve_num_requests_running", "1")] == 1
  assert by_replica[("xlaserve_generation_tokens_total", "1")] == 12
  assert by_replica[("xlaserve_spec_decode_num_accepted_tokens_per_pos_total", "0")] == 1


def test_engine_stats_read_at_scrape_time():
  stats = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_pages_total=8,
                      num_pages_free=6, num_preemptions_total=1, prompt_tokens_total=40,
                      generation_tokens_total=12, prefix_cache_queries_total=32,
                      prefix_cache_hits_total=16, prefill_tokens_computed_total=24,
                      kv_events_dropped_total=5)
  m = Metrics(lambda: stats, model_name="m")
  m.timer().on_finish("stop")
  body, content_type = m.render()
  assert content_type.startswith("text/plain")
  samples = _samples(body.decode())
  for name in REQUIRED:
    assert any(k == name or k.startswith(name + "_") for k in samples), name
  assert samples["xlaserve_num_requests_running"] == 3
  assert samples["xlaserve_kv_cache_usage_perc"] == 0.25
  assert samples["xlaserve_prefix_cache_hits_total"] == 16
  assert samples["xlaserve_kv_events_dropped_total"] == 5
  stats.generation_tokens_total = 20  # read live at the next scrape
  assert _samples(m.render()[0].decode())["xlaserve_generation_tokens_total"] == 20


def test_spec_decode_counters_per_position():
  spec = SpecDecodeCounters()
  spec.record(proposed=4, kept=2)
  spec.record(proposed=3, kept=3)
  spec.record(proposed=0, kept=0)  # a row without drafts counts nothing
  stats = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.0, num_pages_total=8,
                      num_pages_free=8, num_preemptions_total=0, prompt_tokens_total=0,
                      generation_tokens_total=0, prefix_cache_queries_total=0,
                      prefix_cache_hits_total=0, prefill_tokens_computed_total=0,
                      spec_decode=spec)
  text = Metrics(lambda: stats, model_name="m").render()[0].decode()
  samples = _samples(text)
  assert samples["xlaserve_spec_decode_num_drafts_total"] == 2
  assert samples["xlaserve_spec_decode_num_draft_tokens_total"] == 7
  assert samples["xlaserve_spec_decode_num_accepted_tokens_total"] == 5
  name = "xlaserve_spec_decode_num_accepted_tokens_per_pos_total"
  per_pos = {s.labels["position"]: s.value for f in text_string_to_metric_families(text)
             for s in f.samples if s.name == name}
  assert per_pos == {"0": 2, "1": 2, "2": 1, "3": 0}


def test_registries_are_per_server():
  a, b = Metrics(model_name="a"), Metrics(model_name="b")  # no duplicate-name error
  a.timer().on_finish("length")
  assert _samples(a.render()[0].decode())["xlaserve_request_success_total"] == 1
  assert _samples(b.render()[0].decode()).get("xlaserve_request_success_total", 0) == 0


def test_request_timer_math(monkeypatch):
  clock = iter([0.0, 0.5, 0.7, 1.0, 1.0])  # arrival, 1st delta, 2nd, 3rd (2 tokens), finish
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: next(clock))
  m = Metrics(model_name="t")
  t = m.timer()
  t.on_tokens(1)
  t.on_tokens(1)
  t.on_tokens(2)
  t.on_finish("length")
  s = _samples(m.render()[0].decode())
  assert s["xlaserve_time_to_first_token_seconds_sum"] == pytest.approx(0.5)
  assert s["xlaserve_inter_token_latency_seconds_count"] == 3  # 4 tokens -> 3 gaps
  assert s["xlaserve_inter_token_latency_seconds_sum"] == pytest.approx(0.5)
  assert s["xlaserve_time_per_output_token_seconds_sum"] == pytest.approx(0.5 / 3)
  assert s["xlaserve_e2e_request_latency_seconds_sum"] == pytest.approx(1.0)


def test_counters_match_a_known_load():
  engine = fake_engine(max_num_seqs=4, max_model_len=256, num_pages=64)
  with InProcessServer(engine) as s, httpx.Client(base_url=s.http, timeout=20) as c:
    prompts = ["abc", "de", "fghij"]
    for i, p in enumerate(prompts):
      assert c.post("/v1/completions", json={"model": "fake", "prompt": p,
                                             "max_tokens": i + 2}).status_code == 200
    c.post("/v1/completions", json={"model": "fake", "prompt": "abc", "max_tokens": 9,
                                    "stop": ["c"]})
    assert c.post("/v1/completions", json={"model": "fake", "prompt": ""}).status_code == 400
    url = s.http
    assert metric_value(url, "xlaserve_request_success_total", finish_reason="length") == 3
    assert metric_value(url, "xlaserve_request_success_total", finish_reason="stop") == 1
    assert metric_value(url, "xlaserve_prompt_tokens_total") == 3 + 2 + 5 + 3
    assert metric_value(url, "xlaserve_generation_tokens_total") == 2 + 3 + 4 + 3
    assert metric_value(url, "xlaserve_e2e_request_latency_seconds_count") == 4
    assert metric_value(url, "xlaserve_time_to_first_token_seconds_count") == 4
    assert metric_value(url, "xlaserve_inter_token_latency_seconds_count") == 1 + 2 + 3 + 2
    assert metric_value(url, "xlaserve_num_requests_running") == 0
    assert metric_value(url, "xlaserve_kv_cache_usage_perc") == 0


def test_inference_extension_metrics():
  """The model server protocol's metrics (docs/api.md): queued and running requests and KV
  usage as gauges, vLLM's lora_requests_info (state in labels, value the read time) and
  cache_config_info (block size, pool pages)."""
  stats = EngineStats(num_running=2, num_waiting=3, kv_cache_usage=0.5, num_pages_total=96,
                      num_pages_free=48, num_preemptions_total=0, prompt_tokens_total=0,
                      generation_tokens_total=0, prefix_cache_queries_total=0,
                      prefix_cache_hits_total=0, prefill_tokens_computed_total=0,
                      lora_running={"sql": 1, "poem": 1}, lora_waiting={"chat": 2},
                      max_lora=4, page_size=16)
  registry = CollectorRegistry()
  registry.register(metrics_lib.EngineStatsCollector(lambda: stats, {"model_name": "m"},
                                                     clock=lambda: 1234.5))
  families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
  for name in ("xlaserve_num_requests_waiting", "xlaserve_num_requests_running",
               "xlaserve_kv_cache_usage_perc", "xlaserve_lora_requests_info",
               "xlaserve_cache_config_info"):
    assert families[name].type == "gauge", name
  (info,) = families["xlaserve_lora_requests_info"].samples
  assert info.labels == {"model_name": "m", "max_lora": "4", "running_lora_adapters": "poem,sql",
                         "waiting_lora_adapters": "chat"}
  assert info.value == 1234.5
  (cache,) = families["xlaserve_cache_config_info"].samples
  assert (cache.labels["block_size"], cache.labels["num_gpu_blocks"], cache.value) == (
      "16", "96", 1.0)
  stats.lora_running, stats.lora_waiting, stats.max_lora = {}, {}, 0  # LoRA off: still there
  text = Metrics(lambda: stats, model_name="m").render()[0].decode()
  (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "xlaserve_lora_requests_info"]
  assert (info.labels["max_lora"], info.labels["running_lora_adapters"]) == ("0", "")
  assert info.value > 1e9  # Unix time
