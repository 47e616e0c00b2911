"""Data parallel replicas on a real model: dp = 2 on simulated CPU devices.

A worker on 4 simulated CPU devices builds a tiny Llama engine with dp = 1 and
with dp = 2 (`build_engine`: two whole engines, each on its own device, behind
the router of serving/engine/replicas.py) and checks that
- 32 requests submitted at once give the same greedy tokens as dp = 1, with
  each replica taking half of them (its own stats, and its own series in the
  Prometheus metrics);
- each replica's weights and KV pool live on its own device only;
- a shared-prefix workload (4 prefixes: one request each, then 7 more each
  at once) gets at least 90% of the prefix-cache hits one engine gets, every
  later request landing on the replica that holds its prefix;
- dp larger than the devices is refused with the flag to set.
"""

from __future__ import annotations

import sys

import pytest
import shard_testutil as stu


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from tiny_models import save_tiny_model

  root = tmp_path_factory.mktemp("dp")
  save_tiny_model("llama", str(root / "tiny"))
  return stu.run_worker(__file__, str(root / "tiny"), devices=4)


def test_outputs_match_one_engine(result):
  assert result["dp2_tokens"] == result["dp1_tokens"]
  assert all(len(t) == 8 for t in result["dp1_tokens"])


def test_each_replica_takes_half(result):
  assert result["routed"] == [16, 16]
  assert result["generated_per_replica"] == [128, 128]
  assert result["metric_generated"] == {"0": 128.0, "1": 128.0}


def test_each_replica_on_its_own_device(result):
  assert result["param_devices"] == [[0], [1]]
  assert result["kv_devices"] == result["param_devices"]


def test_shared_prefixes_keep_their_hits(result):
  assert result["dp2_hits"] >= 0.9 * result["dp1_hits"] > 0
  assert result["prefix_routed"] == 28  # all but each prefix's first request


def test_too_many_replicas_are_refused(result):
  assert "need 8 devices" in result["too_many"]
  assert "xla_force_host_platform_device_count" in result["too_many"]


def _run(engine, prompts, params) -> list[list[int]]:
  outs = [[] for _ in prompts]
  for i, ids in enumerate(prompts):
    engine.add_request(f"r{i}", ids, params, lambda o, i=i: outs[i].extend(o.token_ids))
  engine.run_until_idle()
  return outs


def _prefix_routing(one, two, shared) -> dict:
  """Prefix-cache hits of one engine and of two replicas on prompts sharing 4 prefixes."""
  from serving.types import SamplingParams

  short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  hits = lambda e: e.stats().prefix_cache_hits_total  # noqa: E731
  before1, before2, routed2 = hits(one), hits(two), two.router.prefix_routed
  for engine in (one, two):  # one request per prefix, then the other 28 at once
    _run(engine, shared[:4], short)
    _run(engine, shared[4:], short)
  return {"dp1_hits": hits(one) - before1, "dp2_hits": hits(two) - before2,
          "prefix_routed": two.router.prefix_routed - routed2}


def _worker(path: str) -> None:
  import json

  import jax
  import numpy as np

  stu.worker_setup()
  from serving.config import EngineConfig
  from serving.entrypoints.engine_builder import build_engine
  from serving.entrypoints.metrics import Metrics
  from serving.types import SamplingParams

  base = dict(max_num_seqs=4, max_model_len=96, page_size=8, num_pages=48,
              max_num_batched_tokens=64, prefill_buckets=(64,), decode_buckets=(4,),
              unroll_layers=False, compilation_cache=False)
  rng = np.random.default_rng(0)
  distinct = [rng.integers(3, 250, size=int(rng.integers(5, 20))).tolist() for _ in range(32)]
  prefixes = [rng.integers(3, 250, size=32).tolist() for _ in range(4)]
  shared = [prefixes[k] + [5 + j, 6 + j] for j in range(8) for k in range(4)]
  greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

  out = {}
  one = build_engine(path, EngineConfig.of(**base))
  out["dp1_tokens"] = _run(one, distinct, greedy)
  two = build_engine(path, EngineConfig.of(**base, dp=2))
  out["dp2_tokens"] = _run(two, distinct, greedy)
  out["routed"] = list(two.router.routed)
  out["generated_per_replica"] = [s.generation_tokens_total for s in two.replica_stats()]
  metrics = Metrics(two.stats, model_name="tiny", replica_stats_fn=two.replica_stats)
  from prometheus_client.parser import text_string_to_metric_families

  out["metric_generated"] = {
      s.labels["replica"]: s.value
      for f in text_string_to_metric_families(metrics.render()[0].decode())
      for s in f.samples if s.name == "xlaserve_generation_tokens_total"}

  def device_ids(tree):
    return sorted({d.id for leaf in jax.tree.leaves(tree) for d in leaf.devices()})

  out["param_devices"] = [device_ids(r.runner.params) for r in two.replicas]
  out["kv_devices"] = [device_ids(r.runner.state.kv) for r in two.replicas]

  out.update(_prefix_routing(one, two, shared))
  try:
    build_engine(path, EngineConfig.of(**base, dp=8))
    out["too_many"] = ""
  except ValueError as e:
    out["too_many"] = str(e)
  for e in (one, two):
    e.shutdown()
  print(json.dumps(out))


if __name__ == "__main__":
  _worker(sys.argv[1])
