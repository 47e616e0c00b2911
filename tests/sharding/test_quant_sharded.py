"""Quantized weights on a mesh: int8 and int4 codes and scales split under tp and ep.

The worker (8 simulated CPU devices) quantizes each tiny model once on the
host (`quantize_params`) and serves those same quantized params unsharded and
on each layout through the runner's own programs. Sharded runs must give the
unsharded greedy tokens and logits (f32 noise only), with the codes and their
group scales split like the weight they belong to, and the compiled HLO must
never all-gather a weight's codes or scales.

Layouts: the tiny Llama (D=64, F=128, 4 heads of 16) at tp=2 splits every
row-parallel input into whole groups of 32; at tp=4, wo's 16 inputs per
device are less than a group, so its input axis stays replicated (the
fallback of `rules.weight_spec`). The tiny Qwen3-MoE (4 experts, M=32) is
quantized in groups of 16 so ep=2 x tp=2 splits expert columns into whole
groups.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

pytestmark = pytest.mark.slow  # quantized weights under tp/ep in an 8-device worker

# family -> (group size, layouts as (tp, ep))
CASES = {"llama": (32, ((1, 1), (2, 1), (4, 1))), "qwen3_moe": (16, ((1, 1), (1, 2), (2, 2)))}
METHODS = ("int8", "int4")
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from tiny_models import save_tiny_model

  paths = []
  for family in CASES:
    path = str(tmp_path_factory.mktemp(family))
    save_tiny_model(family, path)
    paths.append(f"{family}={path}")
  return stu.run_worker(__file__, *paths, timeout=480)


@pytest.mark.parametrize("family", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_sharded_equals_unsharded(family, method, result):
  runs = result[family][method]
  base = runs["1x1"]
  for layout, got in runs.items():
    assert got["tokens"] == base["tokens"], layout
    np.testing.assert_allclose(got["prefill_logits"], base["prefill_logits"],
                               atol=stu.LOGIT_ATOL, err_msg=layout)
    np.testing.assert_allclose(got["decode_logits"], base["decode_logits"],
                               atol=stu.LOGIT_ATOL, err_msg=layout)


@pytest.mark.parametrize("method", METHODS)
def test_codes_and_scales_split_with_their_weight(method, result):
  llama = result["llama"][method]
  # Stacked [L, Out, In] codes: column-parallel wq splits Out, row-parallel w_down In.
  assert llama["2x1"]["specs"]["wq"] == ["P(None, 'tp', None)", "P(None, 'tp', None)"]
  assert llama["2x1"]["specs"]["w_down"] == ["P(None, None, 'tp')", "P(None, None, 'tp')"]
  # tp=4: wo's 16 inputs per device are less than a group of 32, so In is replicated.
  assert llama["4x1"]["specs"]["wo"] == ["P(None, None, None)", "P(None, None, None)"]
  moe = result["qwen3_moe"][method]
  # Experts [L, E, M, D] (we_gate stored Out=M-major) over ep, their columns over tp.
  assert moe["2x2"]["specs"]["we_gate"] == ["P(None, 'ep', 'tp', None)"] * 2
  assert moe["2x2"]["specs"]["we_down"] == ["P(None, 'ep', None, 'tp')"] * 2


@pytest.mark.parametrize("family", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_no_weight_gathers(family, method, result):
  runs = result[family][method]
  weights = {tuple(s) for s in result[family]["weight_shapes"][method]}
  for layout, got in runs.items():
    for step, hlo in got["hlo"].items():
      gathered = {tuple(s) for s in hlo["all_gather_shapes"]}
      assert not gathered & weights, (layout, step, gathered & weights)


def _worker(*specs: str) -> None:
  import checkpoints
  from checkpoints.quantizers import quantize_params
  from serving.runner.model_runner import ModelRunner

  out = {}
  for spec in specs:
    family, path = spec.split("=", 1)
    group, layouts = CASES[family]
    loaded = checkpoints.load_checkpoint(path)
    res = {"weight_shapes": {}}
    for method in METHODS:
      params = quantize_params(loaded.params, method, group_size=group)
      res["weight_shapes"][method] = sorted(stu.weight_shapes(params))
      runs = {}
      for tp, ep in layouts:
        runner = ModelRunner.from_params(params, loaded.config, stu.engine_config(tp=tp, ep=ep),
                                         num_pages=stu.ENGINE_KW["num_pages"])
        drv = stu.Driver(runner)
        tokens, first, dec = drv.generate(stu.PROMPTS, MAX_TOKENS)
        layers = runner.params["layers"]
        specs_of = lambda w: [str(getattr(w.q.sharding, "spec", None)),
                              str(getattr(w.scale.sharding, "spec", None))]
        runs[f"{tp}x{ep}"] = dict(
            tokens=tokens, prefill_logits=first.tolist(), decode_logits=dec.tolist(),
            hlo={k: stu.hlo_collectives(v) for k, v in drv.hlo.items()},
            specs={k: specs_of(w) for k, w in layers.items() if hasattr(w, "q")})
      res[method] = runs
    out[family] = res
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
