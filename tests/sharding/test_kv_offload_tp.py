"""The tiered prefix cache under tensor parallelism: each shard's slice goes to the host
tier and comes back.

A worker on 8 simulated CPU devices serves a tiny Llama at tp = 2 with the KV
pool sharded over the KV heads, through a multi-turn workload that evicts
pages from a small device pool: greedy tokens with the host tier equal those
without, and the tier reloaded pages (int8 KV too: codes and scales per shard).
"""

from __future__ import annotations

import sys

import pytest
import shard_testutil as stu

pytestmark = pytest.mark.slow  # engines at tp = 2 in an 8-device worker process


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from tiny_models import save_tiny_model

  root = tmp_path_factory.mktemp("offload_tp")
  save_tiny_model("llama", str(root))
  return stu.run_worker(__file__, str(root), timeout=600)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_host_tier_at_tp2_matches_tier_off(result, kv_dtype):
  got = result[kv_dtype]
  assert got["on"] == got["off"]
  assert got["reloaded"] > 0 and got["offloaded"] > 0
  assert got["kv_spec"] != "PartitionSpec()"  # the pool really is sharded


def _chat(engine, rounds: int = 5, n: int = 4) -> list[list[int]]:
  """`n` interleaved conversations over a shared prefix, each turn resending the history."""
  import numpy as np

  from serving.types import SamplingParams

  rng = np.random.default_rng(2)
  shared = [int(t) for t in rng.integers(3, stu.VOCAB, 24)]
  history, outs = [list(shared) for _ in range(n)], []
  params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  for turn in range(rounds):
    got = {c: [] for c in range(n)}
    for c in range(n):
      history[c] += [int(t) for t in rng.integers(3, stu.VOCAB, 6)]
      engine.add_request(f"c{c}t{turn}", list(history[c]), params,
                         lambda out, c=c, got=got: got[c].extend(out.token_ids))
    engine.run_until_idle()
    for c in range(n):
      outs.append(got[c])
      history[c] += got[c]
  return outs


def _worker(root: str) -> None:
  import json

  import jax

  from serving.entrypoints.engine_builder import build_engine

  stu.worker_setup()
  assert jax.device_count() == 8
  out = {}
  for kv_dtype in ("float32", "int8"):
    row = {}
    for tiers, gb in (("off", 0.0), ("on", 0.01)):
      config = stu.engine_config(tp=2, max_num_seqs=2, max_model_len=128, num_pages=20,
                                 kv_transfer_pages=4,
                                 kv_cache_dtype=kv_dtype, kv_offload_host_gb=gb)
      engine = build_engine(root, config)
      row[tiers] = _chat(engine)
      stats = engine.stats().kv_offload
      if stats is not None:
        row.update(reloaded=stats.pages_reloaded, offloaded=stats.pages_offloaded,
                   kv_spec=str(engine.runner.state.kv.k.sharding.spec))
    out[kv_dtype] = row
  print(json.dumps(out))


if __name__ == "__main__":
  _worker(sys.argv[1])
