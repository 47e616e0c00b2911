"""GPT-OSS experts over a mesh: expert biases and the clamped SwiGLU on the ep / tp path.

The worker (8 simulated CPU devices) runs the tiny GPT-OSS model's whole
forward (dense attention callback, tests/attention_ref.py) with
`sharding.expert_parallel(cfg)` on params placed by `rules.param_shardings`,
for float and MXFP4 experts, over ep and ep x tp layouts; each must give the
unsharded logits, with the experts (and their gate / up biases) split over ep.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu

LAYOUTS = ((1, 4), (2, 2), (2, 1))  # (tp, ep)
PROMPT = [int(i) for i in np.random.RandomState(3).randint(0, 256, 24)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from mxfp4_testutil import save_tiny_mxfp4_model

  from tiny_models import save_tiny_model

  paths = {"float": str(tmp_path_factory.mktemp("float")),
           "mxfp4": str(tmp_path_factory.mktemp("mxfp4"))}
  save_tiny_model("gpt_oss", paths["float"])
  save_tiny_mxfp4_model(paths["mxfp4"])
  return stu.run_worker(__file__, *[f"{k}={v}" for k, v in paths.items()])


@pytest.mark.parametrize("kind", ["float", "mxfp4"])
def test_sharded_experts_match_unsharded(kind, result):
  base = np.asarray(result[kind]["1x1"]["logits"])
  for tp, ep in LAYOUTS:
    got = result[kind][f"{tp}x{ep}"]
    np.testing.assert_allclose(np.asarray(got["logits"]), base, atol=stu.LOGIT_ATOL,
                               err_msg=f"{kind} tp={tp} ep={ep}")
    assert ("ep" in got["experts_spec"]) == (ep > 1), got
    assert ("ep" in got["bias_spec"]) == (ep > 1) and ("tp" in got["bias_spec"]) == (tp > 1)


def _worker(*specs: str) -> None:
  import jax
  from attention_ref import dense_logits

  import checkpoints
  from serving.models.quantized import is_quantized
  from sharding import ParallelConfig, expert_parallel, mesh_for, rules

  out = {}
  for spec in specs:
    kind, path = spec.split("=", 1)
    loaded = checkpoints.load_checkpoint(path)
    cfg, params = loaded.config, loaded.params
    res = {"1x1": {"logits": np.asarray(dense_logits(params, cfg, PROMPT)).tolist()}}
    for tp, ep in LAYOUTS:
      mesh = mesh_for(ParallelConfig(tp=tp, ep=ep))
      placed = jax.device_put(params, rules.param_shardings(params, cfg, mesh))
      with jax.set_mesh(mesh):
        logits = jax.jit(lambda p, cfg=cfg: dense_logits(p, cfg, PROMPT, expert_parallel(cfg))
                         )(placed)
      gate = placed["layers"]["we_gate"]
      gate = gate.q if is_quantized(gate) else gate
      res[f"{tp}x{ep}"] = dict(logits=np.asarray(logits).tolist(),
                               experts_spec=str(gate.sharding.spec),
                               bias_spec=str(placed["layers"]["be_gate"].sharding.spec))
    out[kind] = res
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
