"""Qwen3-Next through the engine over a mesh: tp (attention and linear-attention heads
split), ep and tp x ep for the MoE variant, tp for the dense one.

The worker (4 simulated CPU devices) builds one engine per layout and runs a
ragged batch (prompts shorter and longer than the 16-token prefill chunk, so
the linear layers' state slots carry across chunks); each layout's greedy tokens
must equal transformers' and its first-step top logprobs be within 1e-4. The
linear-attention projections must be split over tp (whole key-head groups) and
the experts over ep where those axes are > 1.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"qwen3_next": ({"tp": 2}, {"ep": 2}, {"tp": 2, "ep": 2}),
           "qwen3_next_dense": ({"tp": 2},)}
PROMPTS = [[3, 17, 101, 45, 8, 250, 77, 12, 5, 60, 33, 21], [200, 31, 9, 144, 2],
           list(range(40, 70))]
NEW_TOKENS = 12
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  from tiny_models import save_tiny_model

  dirs = {k: str(tmp_path_factory.mktemp(k)) for k in LAYOUTS}
  return {k: (d, save_tiny_model(k, d)) for k, d in dirs.items()}


@pytest.fixture(scope="module")
def result(models):
  return stu.run_worker(__file__, *[f"{k}={p}" for k, (p, _) in models.items()], devices=4,
                        timeout=1200)


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
    assert ("'tp'" in got["linear_spec"]) == (layout.get("tp", 1) > 1), got
    if kind == "qwen3_next":
      assert ("'ep'" in got["experts_spec"]) == (layout.get("ep", 1) > 1), got


def _worker(*specs: str) -> None:
  from serving.entrypoints.engine_builder import build_engine
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
      experts = layers.get("sub_we_gate")
      res[stu.layout_name(layout)] = dict(
          tokens=[sum((o.token_ids for o in outs[i]), []) for i in outs],
          first_top=[[list(t) for t in outs[i][0].logprobs[0].top] for i in outs],
          linear_spec=str(layers["lin_qkv"].sharding.spec),
          experts_spec=str(experts.sharding.spec) if experts is not None else "")
    out[kind] = res
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
