"""LoRA under tensor parallelism: tp = 2 and 4 give the tp = 1 output, adapters split.

A worker on 8 simulated CPU devices serves a tiny Llama (4 query heads, 2 KV
heads) with two random adapters through the engine at tp = 1, 2 (per-layer
params) and 4 (stacked params; each KV head repeated twice, so the adapters'
K/V columns are repeated with them), in a batch that mixes them with the base
model. Greedy tokens must be identical and first-step logprobs within 1e-4;
the adapters' A and B are split like the base weight they modify (column-
parallel wq: B over tp; row-parallel wo: A over tp).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

pytestmark = pytest.mark.slow  # LoRA under tp in an 8-device worker process

TPS = (1, 2, 4)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from lora_testutil import write_peft_adapter

  from checkpoints.lora import module_dims
  from serving.models.model_config import ModelConfig
  from tiny_models import save_tiny_model

  root = tmp_path_factory.mktemp("lora_tp")
  save_tiny_model("llama", str(root / "base"))
  cfg = ModelConfig(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
  for i, rank in enumerate((4, 8)):
    write_peft_adapter(str(root / f"a{i}"), module_dims(cfg), 2, rank=rank, seed=i, std=0.2)
  return stu.run_worker(__file__, str(root))


def test_tp_matches_tp1(result):
  base = result["1"]
  assert len({tuple(t) for t in base["tokens"]}) == 3  # the adapters change the output
  for tp in TPS[1:]:
    got = result[str(tp)]
    assert got["tokens"] == base["tokens"], tp
    np.testing.assert_allclose(got["first_logprobs"], base["first_logprobs"], atol=1e-4)


def test_adapters_split_like_their_weights(result):
  assert result["2"]["wq_b_spec"] == "P(None, None, 'tp')"  # [S, R, N*H]: columns
  assert result["2"]["wo_a_spec"] == "P('tp', None, None)"  # [N*H, S, R]: rows
  assert result["4"]["wk_b_shape"][-1] == 2 * result["1"]["wk_b_shape"][-1]  # repeated heads
  assert result["4"]["wq_b_spec"] == "P(None, None, None, 'tp')"  # stacked [L, S, R, N*H]


def _worker(root: str) -> None:
  import json

  import jax

  from serving.entrypoints.engine_builder import build_engine
  from serving.types import SamplingParams

  stu.worker_setup()
  params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
  out = {}
  for tp in TPS:
    config = stu.engine_config(tp=tp, unroll_layers=tp == 2, max_loras=2, max_lora_rank=8,
                               max_num_seqs=4)
    engine = build_engine(f"{root}/base", config,
                          lora_modules={"a0": f"{root}/a0", "a1": f"{root}/a1"})
    results = {}
    for i, lora in enumerate((None, "a0", "a1")):
      results[i] = []
      engine.add_request(f"r{i}", stu.PROMPTS[0], params, results[i].append, lora=lora)
    engine.run_until_idle()
    tokens = [sum((o.token_ids for o in results[i]), []) for i in range(3)]
    first = [sorted(results[i][0].logprobs[0].top) for i in range(3)]
    lora = engine.runner.lora
    layer = lora[0] if isinstance(lora, list) else lora
    out[str(tp)] = {
        "tokens": tokens, "first_logprobs": [[lp for _, lp in f] for f in first],
        "wq_b_spec": str(getattr(layer["wq"][1].sharding, "spec", None)),
        "wo_a_spec": str(getattr(layer["wo"][0].sharding, "spec", None)),
        "wk_b_shape": list(layer["wk"][1].shape)}
    assert jax.device_count() == 8
  print(json.dumps(out))


if __name__ == "__main__":
  _worker(sys.argv[1])
