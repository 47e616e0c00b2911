"""Gemma 2 / Gemma 3 under tensor and pipeline parallelism (4 simulated CPU devices).

One worker runs each tiny model through the runner's own prefill / decode
programs at tp = 2, pp = 2 and pp = 2 x tp = 2 (Gemma 3: layers 0-2 on stage
0, the full-attention layer 5 on stage 1, so each stage must know its layers'
global ids for their windows and RoPE bases) and reports greedy tokens and
logits; they must equal one device's and `transformers`' greedy tokens.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "pp2tp2": {"pp": 2, "tp": 2}}
FAMILIES = ("gemma2", "gemma3")
NUM_TOKENS = 16  # 10-token prompt + 16 > 2 windows of 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  from tiny_models import save_tiny_model

  out = {}
  for family in FAMILIES:
    path = str(tmp_path_factory.mktemp(family))
    out[family] = (path, save_tiny_model(family, path))
  return out


@pytest.fixture(scope="module")
def result(models):
  return stu.run_worker(__file__, *(models[f][0] for f in FAMILIES), devices=4, timeout=600,
                        env={"XLASERVE_NATIVE": "0"})  # traced windows: XLA attention


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_match_one_device_and_transformers(result, models, family):
  from tiny_models import torch_greedy

  want = [torch_greedy(models[family][1], p, NUM_TOKENS)[0] for p in stu.PROMPTS]
  base = result[family]["1"]
  assert base["tokens"] == want
  for name in list(LAYOUTS)[1:]:
    got = result[family][name]
    assert got["tokens"] == want, (family, name)
    np.testing.assert_allclose(got["prefill_logits"], base["prefill_logits"],
                               atol=stu.LOGIT_ATOL)
    np.testing.assert_allclose(got["decode_logits"], base["decode_logits"], atol=stu.LOGIT_ATOL)


def _worker(*paths: str) -> None:
  import checkpoints

  out = {}
  for family, path in zip(FAMILIES, paths, strict=True):
    loaded = checkpoints.load_checkpoint(path)
    out[family] = {}
    for name, layout in LAYOUTS.items():
      drv = stu.Driver(stu.make_runner(loaded, **layout))
      tokens, first, dec = drv.generate(stu.PROMPTS, NUM_TOKENS)
      out[family][name] = dict(tokens=tokens, prefill_logits=first.tolist(),
                               decode_logits=dec.tolist())
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
