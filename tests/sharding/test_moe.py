"""MoE: tiny Mixtral and Qwen3-MoE vs transformers, unsharded and over tp x ep.

The worker (8 simulated CPU devices) prefills two prompts of different
lengths and decodes them together as one ragged batch, for each layout
(tp, ep); the test compares every position's logits with the transformers
model run on the same tokens (float32, atol 2e-4), sharded layouts with the
unsharded run (atol 1e-4, identical greedy tokens), and checks the compiled
HLO: the expert outputs are all-reduced (psum over ep and tp) and no full
expert or attention weight is all-gathered.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = {"mixtral": ((1, 1), (2, 4)), "qwen3_moe": ((1, 1), (1, 4), (4, 2))}
HF_ATOL = 2e-4
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  from tiny_models import save_tiny_model

  out = {}
  for family in LAYOUTS:
    path = str(tmp_path_factory.mktemp(family))
    out[family] = (path, save_tiny_model(family, path))
  return out


@pytest.fixture(scope="module")
def result(models):
  return stu.run_worker(__file__, *[f"{f}={p}" for f, (p, _) in models.items()])


def _hf_logits(model, prompt: list[int], generated: list[int]) -> np.ndarray:
  """transformers logits at the prompt's last position and each decoded one."""
  import torch

  ids = torch.tensor([prompt + generated[:-1]])
  with torch.no_grad():
    logits = model(ids).logits[0].float().numpy()
  return logits[len(prompt) - 1:]


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_matches_transformers(family, models, result):
  model = models[family][1]
  got = result[family]["1x1"]
  for i, prompt in enumerate(stu.PROMPTS):
    ref = _hf_logits(model, prompt, got["tokens"][i])
    ours = np.concatenate([np.asarray(got["prefill_logits"])[i:i + 1],
                           np.asarray(got["decode_logits"])[:, i]])
    np.testing.assert_allclose(ours, ref, atol=HF_ATOL, err_msg=f"{family} prompt {i}")


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_sharded_layouts_match(family, result):
  base = result[family]["1x1"]
  for tp, ep in LAYOUTS[family][1:]:
    got = result[family][f"{tp}x{ep}"]
    assert got["tokens"] == base["tokens"], (tp, ep)
    for key in ("prefill_logits", "decode_logits"):
      np.testing.assert_allclose(got[key], base[key], atol=stu.LOGIT_ATOL, err_msg=key)
    assert "ep" in got["expert_spec"] and (tp == 1 or "tp" in got["expert_spec"])


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_hf_read_per_device_block(family, result):
  assert result[family]["hf_sliced_equal"]  # checkpoints.hf_sharded at the last layout


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_hlo(family, result):
  weights = {tuple(s) for s in result[family]["weight_shapes"]}
  for tp, ep in LAYOUTS[family][1:]:
    for step, hlo in result[family][f"{tp}x{ep}"]["hlo"].items():
      assert hlo["counts"]["all-reduce"] >= 1, (tp, ep, step)
      gathered = {tuple(s) for s in hlo["all_gather_shapes"]}
      assert not gathered & weights, (tp, ep, step, gathered & weights)
      # The only all-gather is of the [B, V] logits (never the KV cache or activations).
      assert all(len(g) == 2 and g[1] == stu.VOCAB for g in gathered), (tp, ep, step, gathered)


def _worker(*specs: str) -> None:
  import checkpoints
  from sharding import ParallelConfig

  out = {}
  for spec in specs:
    family, path = spec.split("=", 1)
    loaded = checkpoints.load_checkpoint(path)
    res = {"weight_shapes": sorted(stu.weight_shapes(loaded.params))}
    tp, ep = LAYOUTS[family][-1]
    res["hf_sliced_equal"] = stu.hf_sliced_equal(path, loaded, ParallelConfig(tp=tp, ep=ep))
    for tp, ep in LAYOUTS[family]:
      runner = stu.make_runner(loaded, tp=tp, ep=ep)
      drv = stu.Driver(runner)
      tokens, first, dec = drv.generate(stu.PROMPTS, MAX_TOKENS)
      res[f"{tp}x{ep}"] = dict(
          tokens=tokens, prefill_logits=first.tolist(), decode_logits=dec.tolist(),
          hlo={k: stu.hlo_collectives(v) for k, v in drv.hlo.items()},
          expert_spec=str(getattr(runner.params["layers"]["we_gate"].sharding, "spec", None)))
    out[family] = res
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
