"""Prometheus metrics for the servers (prefix `xlaserve_`, vLLM's names).

Two sources, one per-server `CollectorRegistry` (no global state):
  1. Engine state (running / waiting requests, KV cache usage, token and
     prefix-cache counters, the tiered prefix cache's hits / misses / bytes per
     tier and offload / reload times, LoRA adapters in use and slot swaps, speculative
     decoding's drafts and accepted tokens per position) is read from
     `engine.stats()` at scrape time by a custom collector, so it is never
     stale and costs nothing between scrapes. An engine made of several
     (dp replicas, prefill / decode workers) gets one series per member,
     labelled `replica` and `role` (`EngineClient.replica_stats()`), and a
     disaggregated one its KV transfer counters (`transfer_stats()`). The Gateway API
     Inference Extension's model server protocol is served by the same names:
     `num_requests_waiting` (queued requests), `num_requests_running`,
     `kv_cache_usage_perc` (0..1), vLLM's `lora_requests_info` and `cache_config_info`
     (docs/api.md says how to point the endpoint picker at them).
  2. Per-request latencies (time to first token, inter-token latency, time per
     output token, end-to-end) and `request_success_total{finish_reason}` are
     observed by the async front end (`serving.entrypoints.async_engine`) through a
     `RequestTimer` per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from serving.engine import EngineClient

PREFIX = "xlaserve_"

# Bucket edges follow vLLM's defaults (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Why the async front end refuses a request before the engine (request_rejected_total).
REJECT_REASONS = ("unavailable", "draining", "queue_full")

# lora_requests_info's labels after the series labels (vLLM's names, which the inference
# extension's endpoint picker reads).
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")

# (metric name without prefix, EngineStats field, help) read at scrape time.
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the decode batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache pages in use (0..1)."),
    ("kv_cache_pages_total", "num_pages_total", "KV cache pages in the pool."),
    ("kv_cache_pages_free", "num_pages_free", "KV cache pages free."),
)
_COUNTERS = (
    ("num_preemptions_total", "num_preemptions_total", "Requests preempted (KV pages reclaimed)."),
    ("prompt_tokens_total", "prompt_tokens_total", "Prompt tokens of admitted requests."),
    ("generation_tokens_total", "generation_tokens_total", "Tokens generated."),
    ("prefix_cache_queries_total", "prefix_cache_queries_total", "Prefix cache queries (tokens)."),
    ("prefix_cache_hits_total", "prefix_cache_hits_total", "Prefix cache hits (tokens)."),
    ("prefill_tokens_computed_total", "prefill_tokens_computed_total",
     "Prompt tokens actually computed by prefill (not served from the prefix cache)."),
    ("lora_swaps_total", "lora_swaps_total", "LoRA adapters written into a device slot."),
    ("kv_events_dropped_total", "kv_events_dropped_total",
     "KV-event batches dropped on a full publisher queue (subscribers see a sequence gap)."),
)


class EngineStatsCollector(Collector):
  """Reads `stats_fn()` (an `EngineStats`) on every scrape; with `replica_stats_fn`
  (data parallel replicas, serving/engine/replicas.py, or the prefill and decode
  workers of serving/engine/disaggregated.py) one series per engine instead,
  labelled `role` (`replica_roles`: "prefill" / "decode"; "both" for replicas that
  do both) and `replica` (its index within the role)."""

  def __init__(self, stats_fn: Callable[[], Any], labels: dict[str, str],
               replica_stats_fn: Callable[[], list[Any]] | None = None,
               replica_roles: list[str] | None = None, clock: Callable[[], float] = time.time):
    self._stats_fn = stats_fn
    self._clock = clock  # lora_requests_info's value
    self._labels = labels
    self._replica_stats_fn = replica_stats_fn
    self._roles = replica_roles

  def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    names, values = list(self._labels), list(self._labels.values())
    if self._replica_stats_fn is None:
      rows = [(values, self._stats_fn())]
    else:
      names = [*names, "replica", "role"]
      parts = self._replica_stats_fn()
      roles = self._roles or ["both"] * len(parts)
      rows = [([*values, str(roles[:i].count(roles[i])), roles[i]], s)
              for i, s in enumerate(parts)]
    for name, field, doc in _GAUGES:
      family = GaugeMetricFamily(PREFIX + name, doc, labels=names)
      for row, stats in rows:
        family.add_metric(row, float(getattr(stats, field)))
      yield family
    for name, field, doc in _COUNTERS:
      family = CounterMetricFamily(PREFIX + name, doc, labels=names)
      for row, stats in rows:
        family.add_metric(row, float(getattr(stats, field)))
      yield family
    family = GaugeMetricFamily(PREFIX + "lora_requests_running",
                               "Running requests per LoRA adapter (adapters in use only).",
                               labels=[*names, "lora_name"])
    for row, stats in rows:
      for adapter, count in sorted(stats.lora_running.items()):
        family.add_metric([*row, adapter], float(count))
    yield family
    yield _lora_info_family(rows, names, self._clock())
    yield _cache_config_family(rows, names)
    yield from _spec_decode_families([(row, stats.spec_decode) for row, stats in rows], names)
    yield from _offload_families([(row, stats.kv_offload) for row, stats in rows
                                  if stats.kv_offload is not None], names)


def _adapter_list(counts: dict[str, int]) -> str:
  return ",".join(sorted(counts))


def _lora_info_family(rows: list[tuple[list[str], Any]], names: list[str],
                      now: float) -> GaugeMetricFamily:
  """vLLM's `lora_requests_info` (the inference extension's LoRA metric): per engine, one
  series whose labels are the state and whose value is when it was read (Unix seconds; the
  endpoint picker keeps the newest). Exported with LoRA off too (`max_lora` "0")."""
  family = GaugeMetricFamily(
      PREFIX + "lora_requests_info",
      "LoRA state, in its labels: max_lora (adapters a batch can hold), running_lora_adapters "
      "and waiting_lora_adapters (comma-separated adapters of running / waiting requests); "
      "value: Unix time the state was read.",
      labels=[*names, *LORA_INFO_LABELS])
  for row, stats in rows:
    family.add_metric([*row, str(stats.max_lora), _adapter_list(stats.lora_running),
                       _adapter_list(stats.lora_waiting)], now)
  return family


def _cache_config_family(rows: list[tuple[list[str], Any]],
                         names: list[str]) -> GaugeMetricFamily:
  """vLLM's `cache_config_info` (value 1): the KV page size and page count, the inference
  extension's optional BlockSize and NumGPUBlocks."""
  family = GaugeMetricFamily(PREFIX + "cache_config_info",
                             "KV cache configuration, in its labels: block_size (tokens per "
                             "page) and num_gpu_blocks (pages in the pool); value 1.",
                             labels=[*names, "block_size", "num_gpu_blocks"])
  for row, stats in rows:
    family.add_metric([*row, str(stats.page_size), str(stats.num_pages_total)], 1.0)
  return family


# (metric name without prefix, SpecDecodeCounters field, help): vLLM's spec_decode names.
_SPEC_COUNTERS = (
    ("spec_decode_num_drafts_total", "num_drafts",
     "Speculative decode rows that verified at least one draft token."),
    ("spec_decode_num_draft_tokens_total", "num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens_total", "num_accepted_tokens", "Draft tokens accepted."),
)


def _spec_decode_families(rows: list[tuple[list[str], Any]], names: list[str]):
  for name, field, doc in _SPEC_COUNTERS:
    family = CounterMetricFamily(PREFIX + name, doc, labels=names)
    for values, counters in rows:
      family.add_metric(values, float(getattr(counters, field)))
    yield family
  family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                               "Draft tokens accepted at each position of a row's drafts "
                               "(0: the first draft).", labels=[*names, "position"])
  for values, counters in rows:
    for pos, count in enumerate(counters.accepted_per_pos):
      family.add_metric([*values, str(pos)], float(count))
  yield family


# The tiered prefix cache (serving/engine/kv_offload.py): per tier (label `tier`).
_TIER_COUNTERS = (
    ("kv_offload_hits_total", "hits", "KV pages a prefix lookup found in the tier."),
    ("kv_offload_misses_total", "misses", "KV pages a prefix lookup did not find in the tier."),
    ("kv_offload_stored_pages_total", "pages_stored", "KV pages written into the tier."),
    ("kv_offload_stored_bytes_total", "bytes_stored", "Bytes of KV pages written into the tier."),
)
_TIER_GAUGES = (
    ("kv_offload_used_bytes", "used_bytes", "Bytes of KV pages the tier holds."),
    ("kv_offload_capacity_bytes", "capacity_bytes", "Bytes the tier may hold."),
    ("kv_offload_disabled", "disabled", "1 when the tier was disabled (a failed disk write)."),
)
_OFFLOAD_COUNTERS = (
    ("kv_offload_pages_total", "pages_offloaded", "KV pages copied from the device to the host."),
    ("kv_offload_seconds_total", "offload_seconds",
     "Seconds from gathering evicted pages to their landing in the host tier, per chunk."),
    ("kv_offload_chunks_total", "offload_chunks", "Chunks of evicted pages copied to the host."),
    ("kv_reload_pages_total", "pages_reloaded", "KV pages written back from a tier."),
    ("kv_reload_seconds_total", "reload_seconds", "Host seconds spent in reload transfers."),
    ("kv_reload_steps_total", "reload_steps", "Steps that reloaded pages."),
    ("kv_reload_failures_total", "reload_failures",
     "Requests that recomputed a prefix after a failed reload."),
    ("kv_prefetch_pages_total", "pages_prefetched",
     "Disk-tier pages read ahead of admission by the reader thread."),
    ("kv_prefetch_misses_total", "prefetch_misses",
     "Disk-tier pages a request recomputed: read too late, failed, or not read."),
)


def _offload_families(rows: list[tuple[list[str], Any]], names: list[str]):
  if not rows:
    return
  for metrics, cls in ((_TIER_COUNTERS, CounterMetricFamily), (_TIER_GAUGES, GaugeMetricFamily)):
    for name, field, doc in metrics:
      family = cls(PREFIX + name, doc, labels=[*names, "tier"])
      for values, stats in rows:
        for tier in ("host", "disk"):
          tier_stats = getattr(stats, tier)
          if tier_stats is not None:
            family.add_metric([*values, tier], float(getattr(tier_stats, field)))
      yield family
  for name, field, doc in _OFFLOAD_COUNTERS:
    family = CounterMetricFamily(PREFIX + name, doc, labels=names)
    for values, stats in rows:
      family.add_metric(values, float(getattr(stats, field)))
    yield family


class TransferCollector(Collector):
  """KV transfers of a disaggregated engine (`transfer_stats_fn()`: name -> count); the
  counters it returns are exported (none for an engine that moves no KV)."""

  DOCS = {"kv_transfers_total": "Requests whose KV pages moved from a prefill to a decode "
                                "worker.",
          "kv_transfer_failures_total": "Requests failed by their prefill or KV transfer.",
          "kv_transfer_pages_total": "KV pages moved from prefill to decode workers."}

  def __init__(self, transfer_stats_fn: Callable[[], dict[str, int]], labels: dict[str, str]):
    self._fn, self._labels = transfer_stats_fn, labels

  def collect(self) -> Iterator[CounterMetricFamily]:
    stats = self._fn()
    for name, doc in self.DOCS.items():
      if name not in stats:
        continue
      family = CounterMetricFamily(PREFIX + name, doc, labels=list(self._labels))
      family.add_metric(list(self._labels.values()), float(stats[name]))
      yield family


class Metrics:
  """All metrics of one server process, in their own registry."""

  def __init__(self, stats_fn: Callable[[], Any] | None = None, model_name: str = "",
               replica_stats_fn: Callable[[], list[Any]] | None = None,
               replica_roles: list[str] | None = None,
               transfer_stats_fn: Callable[[], dict[str, int]] | None = None):
    """`replica_stats_fn`: each engine's `EngineStats` (data parallel replicas, or
    prefill / decode workers, whose role each `replica_roles` entry names): engine
    metrics then have one series per engine, labelled `replica` and `role`.
    `transfer_stats_fn`: a disaggregated engine's KV transfer counters."""
    self.registry = CollectorRegistry(auto_describe=True)
    labels = {"model_name": model_name}
    label_names = list(labels)
    self.labels = labels  # the series labels every metric carries
    if stats_fn is not None:
      self.registry.register(EngineStatsCollector(stats_fn, labels, replica_stats_fn,
                                                  replica_roles))
    if transfer_stats_fn is not None:
      self.registry.register(TransferCollector(transfer_stats_fn, labels))
    kw = {"registry": self.registry, "labelnames": label_names}
    self.request_success = Counter(
        PREFIX + "request_success_total", "Finished requests by finish reason.",
        labelnames=[*label_names, "finish_reason"], registry=self.registry)
    self.request_rejected = Counter(
        PREFIX + "request_rejected_total", "Requests refused before reaching the engine.",
        labelnames=[*label_names, "reason"], registry=self.registry)
    self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                          "Time from arrival to the first generated token.",
                          buckets=TTFT_BUCKETS, **kw)
    self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                          "Mean time per output token after the first, per request.",
                          buckets=ITL_BUCKETS, **kw)
    self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                         "Time between consecutive generated tokens.", buckets=ITL_BUCKETS, **kw)
    self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                         "Time from arrival to the last token.", buckets=E2E_BUCKETS, **kw)

    # Create every labelled series up front so that they are exported (as 0) before traffic.
    for hist in (self.ttft, self.tpot, self.itl, self.e2e):
      hist.labels(**labels)
    for reason in ("stop", "length", "abort", "error"):
      self.request_success.labels(**labels, finish_reason=reason)
    for reason in REJECT_REASONS:
      self.request_rejected.labels(**labels, reason=reason)

  @classmethod
  def for_engine(cls, engine: EngineClient, model_name: str = "") -> Metrics:
    """A server's metrics over `engine`: its stats (one series per member engine when it
    has several) and its KV transfer counters."""
    roles = engine.replica_roles
    several = len(roles) > 1
    return cls(engine.stats, model_name=model_name,
               replica_stats_fn=engine.replica_stats if several else None,
               replica_roles=roles if several else None,
               transfer_stats_fn=engine.transfer_stats)

  def timer(self) -> RequestTimer:
    return RequestTimer(self)

  def reject(self, reason: str) -> None:
    self.request_rejected.labels(**self.labels, reason=reason).inc()

  def render(self) -> tuple[bytes, str]:
    """The Prometheus text exposition and its content type."""
    return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
  """Observes one request's latencies as its deltas arrive."""

  def __init__(self, metrics: Metrics):
    self._m = metrics
    self._arrival = time.perf_counter()
    self._first: float | None = None
    self._last: float | None = None
    self._tokens = 0

  def on_tokens(self, num_tokens: int) -> None:
    """Called when a delta with `num_tokens` new tokens arrives."""
    if num_tokens <= 0:
      return
    now = time.perf_counter()
    labels = self._m.labels
    if self._first is None:
      # Tokens of the first delta all count as "first"; there is no gap to observe.
      self._first = now
      self._m.ttft.labels(**labels).observe(now - self._arrival)
    else:
      # Tokens that arrive together share the gap since the previous delta.
      gap = (now - self._last) / num_tokens
      itl = self._m.itl.labels(**labels)
      for _ in range(num_tokens):
        itl.observe(gap)
    self._tokens += num_tokens
    self._last = now

  def on_finish(self, finish_reason: str) -> None:
    now = time.perf_counter()
    labels = self._m.labels
    self._m.request_success.labels(**labels, finish_reason=finish_reason).inc()
    self._m.e2e.labels(**labels).observe(now - self._arrival)
    if self._first is not None and self._tokens > 1:
      self._m.tpot.labels(**labels).observe((self._last - self._first) / (self._tokens - 1))
