"""DeepSeek-V3 (MLA, grouped-routing MoE) through the engine over a mesh: tp, ep, tp x ep,
pp (3 layers padded to 4 for two stages; each stage its layers' latent pages).

The worker (simulated CPU devices) builds one engine per layout and runs a
ragged batch of prompts at once (one longer than the prefill budget); each
layout's greedy tokens must equal transformers' and its first-step top
logprobs be within 1e-4. Under tp the heads' projections (`wq_b`, `w_uk`,
`w_uv`, `wo`) split over tp and the latent cache stays whole on every device
(the one latent row is every head's key and value); under ep the routed
experts split over ep.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = ({"tp": 2}, {"ep": 2}, {"tp": 2, "ep": 2}, {"pp": 2})
PROMPTS = [[3, 17, 101, 45, 8, 250, 77, 12, 5, 60, 33, 21], [200, 31, 9, 144, 2],
           list(range(40, 80))]
NEW_TOKENS = 12
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  from tiny_models import save_tiny_model

  path = str(tmp_path_factory.mktemp("deepseek"))
  return path, save_tiny_model("deepseek_v3", path)


@pytest.fixture(scope="module")
def result(model):
  return stu.run_worker(__file__, model[0], timeout=900)


@pytest.mark.slow
def test_layouts_match_transformers(model, result):
  from tiny_models import torch_greedy

  refs = [torch_greedy(model[1], p, NEW_TOKENS) for p in PROMPTS]
  for layout in LAYOUTS:
    got = result[stu.layout_name(layout)]
    for i, (ref_tokens, ref_lp) in enumerate(refs):
      assert got["tokens"][i] == ref_tokens, (layout, i)
      ids, lps = zip(*got["first_top"][i], strict=True)
      np.testing.assert_allclose(lps, ref_lp[list(ids)], atol=LOGPROB_TOL, err_msg=str(layout))
    tp, ep = layout.get("tp", 1) > 1, layout.get("ep", 1) > 1
    assert ("'tp'" in got["w_uk_spec"]) == tp, got
    assert "'tp'" not in got["cache_spec"], got  # the latent pool is never split by heads
    assert ("'ep'" in got["experts_spec"]) == ep, got


def _worker(path: str) -> None:
  from serving.entrypoints.engine_builder import build_engine
  from serving.types import SamplingParams

  params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=10)
  out = {}
  for layout in LAYOUTS:
    engine = build_engine(path, stu.engine_config(max_num_seqs=4, max_model_len=64,
                                                  num_pages=48, **layout))
    outs = {i: [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
      engine.add_request(f"r{i}", prompt, params, outs[i].append)
    engine.run_until_idle()
    layers = engine.runner.params["layers"]
    out[stu.layout_name(layout)] = dict(
        tokens=[sum((o.token_ids for o in outs[i]), []) for i in outs],
        first_top=[[list(t) for t in outs[i][0].logprobs[0].top] for i in outs],
        w_uk_spec=str(layers["w_uk"].sharding.spec),
        cache_spec=str(engine.runner.state.kv.k.sharding.spec),
        experts_spec=str(layers["we_gate"].sharding.spec))
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
