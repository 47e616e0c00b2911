"""Tensor parallelism on 8 simulated CPU devices: a tiny Llama at tp = 1, 2, 4, 8.

One worker subprocess runs every layout through the runner's own programs
and reports logits, greedy tokens, shardings and the collectives of the
compiled HLO; it also serves the model through `LLMEngine(..., tp=2)`.
The tiny Llama has 4 query heads and 2 KV heads: tp=2 splits both, tp=4
repeats each KV head twice (one per device), tp=8 cannot split 4 heads, so
attention is replicated and only the MLP is split (vocab 300 is replicated
at tp=8 too). tp=2 runs the per-layer params form the runner uses on CPU by
default (`causal_lm.unstack_layers`), the others the scanned stacked form.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

TPS = (1, 2, 4, 8)
UNROLLED = (2,)  # runs the per-layer params form (CPU default); the others scan stacked [L, ...]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from tiny_models import save_tiny_model

  path = str(tmp_path_factory.mktemp("llama"))
  save_tiny_model("llama", path)
  return stu.run_worker(__file__, "llama", path)


def test_logits_and_greedy_match_unsharded(result):
  base = result["1"]
  for tp in TPS[1:]:
    got = result[str(tp)]
    assert got["tokens"] == base["tokens"], tp
    np.testing.assert_allclose(got["prefill_logits"], base["prefill_logits"], atol=stu.LOGIT_ATOL)
    np.testing.assert_allclose(got["decode_logits"], base["decode_logits"], atol=stu.LOGIT_ATOL)


def test_layouts(result):
  assert result["2"]["wq_spec"] == "P(None, 'tp')"  # per-layer [D, N*H]
  assert result["2"]["kv_spec"] == "P(None, None, 'tp', None)"
  assert result["4"]["num_kv_heads"] == 4  # 2 KV heads, each repeated twice
  assert result["4"]["kv_spec"] == "P(None, None, 'tp', None)"
  assert result["8"]["wq_spec"] == "P(None, None, None)"  # 4 heads: replicated
  assert result["8"]["w_up_spec"] == "P(None, None, 'tp')"  # F=128 splits


def test_hlo_collectives(result):
  for tp in TPS:
    for step in ("prefill", "decode"):
      hlo = result[str(tp)]["hlo"][step]
      gathered = {tuple(s) for s in hlo["all_gather_shapes"]}
      weights = {tuple(s) for s in result["weight_shapes"]}
      assert not gathered & weights, (tp, step, gathered & weights)
      # The only all-gather is of the [B, V] logits (never the KV cache or activations).
      assert all(len(g) == 2 and g[1] == stu.VOCAB for g in gathered), (tp, step, gathered)
      # Row-parallel wo and w_down outputs are all-reduced over tp: per layer when
      # unrolled (2 layers), once in the scanned body; tp=8 splits only the MLP.
      expected = {1: 0, 2: 4, 4: 2, 8: 1}[tp]
      assert hlo["counts"]["all-reduce"] >= expected, (tp, step, hlo)
      if tp == 1:
        assert sum(hlo["counts"].values()) == 0


def test_engine_tp2_greedy(result):
  assert result["engine_tp2"] == result["1"]["tokens"]
  assert result["engine_programs"] == [1, 1, 1]  # no recompiles after warm-up


def test_speculative_decoding_under_tp2(result):
  assert result["spec_tp2_16"] == result["engine_tp2_16"]
  assert result["spec_draft_tokens"] > 0


def _worker(path: str) -> None:
  import checkpoints
  from serving import LLM, SamplingParams

  loaded = checkpoints.load_checkpoint(path)
  out = {"weight_shapes": sorted(stu.weight_shapes(loaded.params))}
  for tp in TPS:
    runner = stu.make_runner(loaded, tp=tp, unroll_layers=tp in UNROLLED)
    drv = stu.Driver(runner)
    tokens, first, dec = drv.generate(stu.PROMPTS, 6)
    layers = runner.params["layers"]
    layers = layers[0] if isinstance(layers, list) else layers
    out[str(tp)] = dict(
        tokens=tokens, prefill_logits=first.tolist(), decode_logits=dec.tolist(),
        hlo={k: stu.hlo_collectives(v) for k, v in drv.hlo.items()},
        wq_spec=str(getattr(layers["wq"].sharding, "spec", None)),
        w_up_spec=str(getattr(layers["w_up"].sharding, "spec", None)),
        kv_spec=str(getattr(runner.state.kv.k.sharding, "spec", None)),
        num_kv_heads=runner.model_cfg.num_kv_heads)
  llm = LLM(path, tp=2, **{**stu.ENGINE_KW, "max_num_seqs": 1})  # 3 programs
  outs = llm.generate(stu.PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
  out["engine_tp2"] = [o.token_ids for o in outs]
  runner = llm.engine.runner  # warm-up compiled each program once; serving added none
  out["engine_programs"] = [f.num_programs() for f in (runner._prefill, runner._decode,
                                                      runner._sample)]
  # Speculative decoding under tp=2: the verify programs on the mesh, same tokens.
  params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
  out["engine_tp2_16"] = [o.token_ids for o in llm.generate(stu.PROMPTS, params)]
  spec = LLM(path, tp=2, speculative_method="ngram", prompt_lookup_min=1,
             **{**stu.ENGINE_KW, "max_num_seqs": 1})  # 5 programs
  out["spec_tp2_16"] = [o.token_ids for o in spec.generate(stu.PROMPTS, params)]
  out["spec_draft_tokens"] = spec.engine.stats().spec_decode.num_draft_tokens
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[2:])
