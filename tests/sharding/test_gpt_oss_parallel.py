"""GPT-OSS through the engine over a mesh: tp, ep, tp x ep and pp; float and MXFP4 experts.

The worker (8 simulated CPU devices) builds one engine per layout (the real
scheduler, so the sliding layers' window pages too) and runs a ragged batch
of prompts past the tiny model's window (8) at once; each layout's greedy
tokens must equal transformers' and its first-step top logprobs be within
1e-4 (the expert biases and the clamped SwiGLU run inside the
expert-parallel shard_map; the sinks split with the heads; pp pipelines the
stacked layers). The experts and their gate / up biases must be split over
ep where ep > 1.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"float": ({"tp": 2}, {"ep": 2}, {"tp": 2, "ep": 2}, {"pp": 2}),
           "mxfp4": ({"tp": 2, "ep": 2},)}
PROMPTS = [[3, 17, 101, 45, 8, 250, 77, 12, 5, 60, 33, 21], [200, 31, 9, 144, 2],
           list(range(40, 70))]
NEW_TOKENS = 12
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  from mxfp4_testutil import save_tiny_mxfp4_model

  from tiny_models import save_tiny_model

  float_dir, mxfp4_dir = (str(tmp_path_factory.mktemp(k)) for k in LAYOUTS)
  return {"float": (float_dir, save_tiny_model("gpt_oss", float_dir)),
          "mxfp4": (mxfp4_dir, save_tiny_mxfp4_model(mxfp4_dir))}


@pytest.fixture(scope="module")
def result(models):
  return stu.run_worker(__file__, *[f"{k}={p}" for k, (p, _) in models.items()], timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_layouts_match_transformers(kind, models, result):
  from tiny_models import torch_greedy

  refs = [torch_greedy(models[kind][1], p, NEW_TOKENS) for p in PROMPTS]
  for layout in LAYOUTS[kind]:
    got = result[kind][stu.layout_name(layout)]
    for i, (ref_tokens, ref_lp) in enumerate(refs):
      assert got["tokens"][i] == ref_tokens, (layout, i)
      ids, lps = zip(*got["first_top"][i], strict=True)
      np.testing.assert_allclose(lps, ref_lp[list(ids)], atol=LOGPROB_TOL, err_msg=str(layout))
    ep = layout.get("ep", 1) > 1
    assert ("'ep'" in got["experts_spec"]) == ep and ("'ep'" in got["bias_spec"]) == ep, got


def _worker(*specs: str) -> None:
  from serving.entrypoints.engine_builder import build_engine
  from serving.models.quantized import is_quantized
  from serving.types import SamplingParams

  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=10)
  out = {}
  for spec in specs:
    kind, path = spec.split("=", 1)
    res = {}
    for layout in LAYOUTS[kind]:
      engine = build_engine(path, stu.engine_config(max_num_seqs=4, max_model_len=64,
                                                    num_pages=48, **layout))
      outs = {i: [] for i in range(len(PROMPTS))}
      for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params, outs[i].append)
      engine.run_until_idle()
      layers = engine.runner.params["layers"]
      gate = layers["we_gate"].q if is_quantized(layers["we_gate"]) else layers["we_gate"]
      res[stu.layout_name(layout)] = dict(
          tokens=[sum((o.token_ids for o in outs[i]), []) for i in outs],
          first_top=[[list(t) for t in outs[i][0].logprobs[0].top] for i in outs],
          experts_spec=str(gate.sharding.spec), bias_spec=str(layers["be_gate"].sharding.spec))
    out[kind] = res
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
