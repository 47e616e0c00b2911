"""Phi-3 under tensor and pipeline parallelism on simulated CPU devices.

A worker subprocess (8 CPU devices) serves the tiny "phi3" (4 query / 2 KV
heads, RoPE on 3/4 of each head, LongRoPE, a 16-token window on both layers;
tests/tiny_models.py) through the engine at tp = 2 and at pp = 2 (one layer
per stage), with prompts longer than the window and one longer than a
prefill chunk; the greedy tokens must equal `transformers`. The fused
q/k/v and gate/up projections are split at load, so the rule table shards
them as it shards Llama's, and `checkpoints.hf_sharded` reads each device's
block of each part straight from the fused tensor.
"""

from __future__ import annotations

import sys

import pytest
import shard_testutil as stu

LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}}
PROMPTS = [[(7 * i + 3) % 256 for i in range(20)], [(11 * i + 5) % 256 for i in range(37)]]
N_TOKENS = 16


@pytest.fixture(scope="module")
def reference_and_result(tmp_path_factory):
  from tiny_models import save_tiny_model, torch_greedy

  path = str(tmp_path_factory.mktemp("phi3"))
  model = save_tiny_model("phi3", path)
  reference = [torch_greedy(model, p, N_TOKENS)[0] for p in PROMPTS]
  return reference, stu.run_worker(__file__, path, timeout=480)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_greedy_tokens_match_transformers(reference_and_result, layout):
  reference, result = reference_and_result
  assert result[layout]["tokens"] == reference
  assert result[layout]["devices"] == 2


@pytest.mark.slow
def test_fused_parts_read_per_device_block(reference_and_result):
  assert reference_and_result[1]["hf_sliced_equal"]  # checkpoints.hf_sharded at tp=2


def _worker(path: str) -> None:
  import checkpoints
  from serving.entrypoints.engine_builder import build_engine
  from serving.types import SamplingParams
  from sharding import ParallelConfig

  out = {"hf_sliced_equal": stu.hf_sliced_equal(path, checkpoints.load_checkpoint(path),
                                                ParallelConfig(tp=2))}
  params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
  for name, layout in LAYOUTS.items():
    engine = build_engine(path, stu.engine_config(max_model_len=64, num_pages=32,
                                                  max_num_batched_tokens=32, **layout))
    results = {i: [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
      engine.add_request(f"r{i}", prompt, params, results[i].append)
    engine.run_until_idle()
    wq = engine.runner.params["layers"]["wq"]
    out[name] = dict(tokens=[sum((o.token_ids for o in results[i]), [])
                             for i in range(len(PROMPTS))],
                     devices=len(wq.sharding.device_set))
    engine.shutdown()
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
