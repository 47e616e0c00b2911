"""Pipeline parallelism on 8 simulated CPU devices: pp = 2, pp = 4 and pp = 2 x tp = 2.

One worker subprocess runs
- a tiny Llama and a tiny Qwen3-MoE (2 layers each; pp = 4 pads them to 4
  with zero layers) through the runner's own prefill and decode programs
  (4 decode rows: cut into pp microbatches), reporting logits, greedy
  tokens, the layer and KV shardings and the collectives of the compiled HLO;
- the default model (SmolLM2-135M, 30 layers, float32 weights) at pp = 2
  through the `LLM` API on 4 prompts at once (the tiny models cover the other
  layouts and the padding; each layout of the real model is another 30-layer
  compile).

The default model's one-device tokens come from the session's `default_llm`
(tests/conftest.py: the same weights and engine options but for 8 slots and
their decode buckets; 4 rows take the same 64-token prefill and 4-row decode
and multi-step buckets either way), which other modules build anyway.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"1": {}, "pp2": {"pp": 2}, "pp4": {"pp": 4}, "pp2tp2": {"pp": 2, "tp": 2}}
DEFAULT_MODEL_PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3, 4,",
                         "Once upon a time"]
DEFAULT_MODEL_TOKENS = 12
FAMILIES = ("llama", "qwen3_moe")
PROMPTS = [*stu.PROMPTS, [5, 6, 7, 8, 9, 10, 11], [40, 41]]  # 4 rows: a full decode bucket


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from tiny_models import save_tiny_model

  paths = []
  for family in FAMILIES:
    path = str(tmp_path_factory.mktemp(family))
    save_tiny_model(family, path)
    paths.append(path)
  return stu.run_worker(__file__, *paths, timeout=900, fast_compile=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_match_one_device(result, family):
  base = result[family]["1"]
  for name in list(LAYOUTS)[1:]:
    got = result[family][name]
    assert got["tokens"] == base["tokens"], (family, name)
    np.testing.assert_allclose(got["prefill_logits"], base["prefill_logits"],
                               atol=stu.LOGIT_ATOL)
    np.testing.assert_allclose(got["decode_logits"], base["decode_logits"], atol=stu.LOGIT_ATOL)


@pytest.mark.slow
def test_stages_hold_their_layers_only(result):
  got = result["llama"]
  assert got["pp2"]["wq_spec"] == "P('pp', None, None)"
  assert got["pp2"]["kv_spec"] == "P('pp', None, None, None)"
  assert got["pp2"]["wq_shard_layers"] == [1, 1]  # 2 layers: one per stage
  assert got["pp4"]["num_layers"] == 4  # padded with 2 zero layers
  assert got["pp4"]["wq_shard_layers"] == [1, 1, 1, 1]
  assert got["pp2tp2"]["wq_shard_layers"] == [1, 1, 1, 1]  # and half the heads each
  assert got["pp2tp2"]["wq_spec"] == "P('pp', None, 'tp')"
  assert got["pp2tp2"]["kv_spec"] == "P('pp', None, 'tp', None)"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hlo_passes_activations_not_weights(result, family):
  weights = {tuple(s) for s in result[family]["weight_shapes"]}
  for name, layout in LAYOUTS.items():
    stages = layout.get("pp", 1)
    for step in ("prefill", "decode"):
      hlo = result[family][name]["hlo"][step]
      gathered = {tuple(s) for s in hlo["all_gather_shapes"]}
      assert not gathered & weights, (family, name, step, gathered & weights)
      # Only the [B, V] logits are ever gathered (over tp).
      assert all(len(g) == 2 and g[1] == stu.VOCAB for g in gathered), (name, step, gathered)
      # Stage-to-stage sends: one per tick but the last, M = pp microbatches (decode's
      # 4 rows, prefill's 16-token bucket): M + pp - 2 sends.
      expected = 2 * stages - 2
      assert hlo["counts"]["collective-permute"] == expected, (family, name, step, hlo)
      if not layout:
        assert sum(hlo["counts"].values()) == 0


def _greedy():
  from serving import SamplingParams

  return SamplingParams(max_tokens=DEFAULT_MODEL_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_default_model_matches_one_device(result, default_llm):
  base = [list(o.token_ids) for o in default_llm.generate(DEFAULT_MODEL_PROMPTS, _greedy())]
  assert all(len(t) == DEFAULT_MODEL_TOKENS for t in base)
  assert result["default_pp2"] == base


@pytest.mark.slow
def test_no_compiles_after_warm_up(result):
  assert result["default_programs"] == [1, 1, 1]


def test_pad_layers_stacks_and_appends_zero_layers():
  from serving.models.model_config import ModelConfig
  from sharding.pipeline import pad_layers

  cfg = ModelConfig(model_type="llama", vocab_size=300, hidden_size=8, intermediate_size=16,
                    num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4)
  per_layer = [{"wq": np.full((8, 8), i + 1.0, np.float32)} for i in range(3)]
  params, padded = pad_layers({"embed": np.ones((300, 8)), "layers": per_layer}, cfg, 2)
  assert padded.num_layers == 4 and cfg.num_layers == 3
  wq = params["layers"]["wq"]
  assert wq.shape == (4, 8, 8)
  assert [float(wq[i, 0, 0]) for i in range(4)] == [1.0, 2.0, 3.0, 0.0]


def test_mixed_layer_formats_are_refused_with_advice():
  from sharding.pipeline import stack_layers

  with pytest.raises(ValueError, match="one weight format.*--weight_dtype"):
    stack_layers([{"wq": np.zeros((8, 8))}, {"wq": np.zeros((8, 8)), "bq": np.zeros(8)}])


def test_microbatches():
  from sharding.pipeline import microbatches

  assert microbatches(4, 2) == 2
  assert microbatches(4, 4) == 4
  assert microbatches(2, 4) == 1  # rows do not cut evenly: one microbatch
  assert microbatches(8, 1) == 1


def _runner_report(loaded, layout: dict) -> dict:
  runner = stu.make_runner(loaded, max_num_seqs=4, **layout)
  drv = stu.Driver(runner)
  tokens, first, dec = drv.generate(PROMPTS, 6)
  wq = runner.params["layers"]["wq"]
  return dict(tokens=tokens, prefill_logits=first.tolist(), decode_logits=dec.tolist(),
              hlo={k: stu.hlo_collectives(v) for k, v in drv.hlo.items()},
              wq_spec=str(getattr(wq.sharding, "spec", None)),
              kv_spec=str(getattr(runner.state.kv.k.sharding, "spec", None)),
              wq_shard_layers=sorted(s.data.shape[0] for s in wq.addressable_shards),
              num_layers=runner.model_cfg.num_layers)


def _worker(*paths: str) -> None:
  from server_procs import DEFAULT_MODEL, DEFAULT_MODEL_TEST_CONFIG

  import checkpoints
  from serving import LLM

  out = {}
  for family, path in zip(FAMILIES, paths, strict=True):
    loaded = checkpoints.load_checkpoint(path)
    out[family] = {name: _runner_report(loaded, layout) for name, layout in LAYOUTS.items()}
    out[family]["weight_shapes"] = sorted(stu.weight_shapes(loaded.params))
  config = {**DEFAULT_MODEL_TEST_CONFIG, "max_num_seqs": 4, "prefill_buckets": (64,),
            "decode_buckets": (4,), "compilation_cache": False}
  llm = LLM(DEFAULT_MODEL, **config, **LAYOUTS["pp2"])
  out["default_pp2"] = [o.token_ids for o in llm.generate(DEFAULT_MODEL_PROMPTS, _greedy())]
  runner = llm.engine.runner
  out["default_programs"] = [f.num_programs() for f in (runner._prefill, runner._decode,
                                                        runner._sample)]
  llm.engine.shutdown()
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
