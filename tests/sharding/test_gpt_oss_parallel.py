"""GPT-OSS over a mesh: tp, ep, tp x ep and pp, with float and MXFP4 experts.

The worker (8 simulated CPU devices) prefills two prompts longer than the
tiny model's window (10 and 5 tokens, window 8) and decodes them together
through the runner's own programs, for each layout; every layout must give
the one-device tokens and logits (the expert biases and the clamped SwiGLU
run inside the expert-parallel shard_map; the sinks split with the heads),
and the one-device run transformers' logits. The experts (and their gate /
up biases) must actually be split over ep.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"float": ({}, {"tp": 2}, {"ep": 2}, {"tp": 2, "ep": 2}, {"pp": 2}),
           "mxfp4": ({}, {"tp": 2, "ep": 2})}
MAX_TOKENS = 8
HF_ATOL = 2e-4


def _name(layout: dict) -> str:
  return "x".join(f"{k}{v}" for k, v in sorted(layout.items())) or "1"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  from mxfp4_testutil import save_tiny_mxfp4_model

  from tiny_models import save_tiny_model

  float_dir, mxfp4_dir = (str(tmp_path_factory.mktemp(k)) for k in LAYOUTS)
  return {"float": (float_dir, save_tiny_model("gpt_oss", float_dir)),
          "mxfp4": (mxfp4_dir, save_tiny_mxfp4_model(mxfp4_dir))}


@pytest.fixture(scope="module")
def result(models):
  return stu.run_worker(__file__, *[f"{k}={p}" for k, (p, _) in models.items()], timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_one_device_matches_transformers(kind, models, result):
  import torch

  got = result[kind]["1"]
  for i, prompt in enumerate(stu.PROMPTS):
    ids = torch.tensor([prompt + got["tokens"][i][:-1]])
    with torch.no_grad():
      ref = models[kind][1](ids).logits[0].numpy()[len(prompt) - 1:]
    ours = np.concatenate([np.asarray(got["prefill_logits"])[i:i + 1],
                           np.asarray(got["decode_logits"])[:, i]])
    np.testing.assert_allclose(ours, ref, atol=HF_ATOL, err_msg=f"{kind} prompt {i}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_layouts_match_one_device(kind, result):
  base = result[kind]["1"]
  for layout in LAYOUTS[kind][1:]:
    got = result[kind][_name(layout)]
    assert got["tokens"] == base["tokens"], layout
    for key in ("prefill_logits", "decode_logits"):
      np.testing.assert_allclose(got[key], base[key], atol=stu.LOGIT_ATOL, err_msg=key)
    ep = layout.get("ep", 1) > 1
    assert ("'ep'" in got["experts_spec"]) == ep and ("'ep'" in got["bias_spec"]) == ep, got


def _worker(*specs: str) -> None:
  import checkpoints
  from serving.models.quantized import is_quantized

  out = {}
  for spec in specs:
    kind, path = spec.split("=", 1)
    loaded = checkpoints.load_checkpoint(path)
    res = {}
    for layout in LAYOUTS[kind]:
      runner = stu.make_runner(loaded, **layout)
      tokens, first, dec = stu.Driver(runner).generate(stu.PROMPTS, MAX_TOKENS)
      layers = runner.params["layers"]
      gate = layers["we_gate"].q if is_quantized(layers["we_gate"]) else layers["we_gate"]
      res[_name(layout)] = dict(
          tokens=tokens, prefill_logits=first.tolist(), decode_logits=dec.tolist(),
          experts_spec=str(getattr(gate.sharding, "spec", None)),
          bias_spec=str(getattr(layers["be_gate"].sharding, "spec", None)))
    out[kind] = res
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
