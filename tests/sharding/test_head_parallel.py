"""Head-parallel attention (sharding/attention.py) with the Pallas kernels at tp=4.

The runner wraps its Pallas attend callback in `head_parallel`
(serving/runner/steps.py `attend_fn`); the worker runs the tiny Llama with
`attention_backend="pallas_interpret"` at tp=4 (KV heads repeated to 4, one
per device): tokens and logits equal the unsharded run and the HLO gathers
neither a weight nor the KV cache.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import shard_testutil as stu


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  from tiny_models import save_tiny_model

  path = str(tmp_path_factory.mktemp("llama"))
  save_tiny_model("llama", path)
  return stu.run_worker(__file__, path)


def test_pallas_kernels_per_head_shard(result):
  assert result["tp4"]["tokens"] == result["tp1"]["tokens"]
  np.testing.assert_allclose(result["tp4"]["logits"], result["tp1"]["logits"],
                             atol=stu.LOGIT_ATOL)
  assert result["kv_shard_shape"][2] == 1  # one KV head per device
  big = {tuple(s) for s in result["weight_shapes"]} | {tuple(result["kv_shape"])}
  for step, hlo in result["hlo"].items():
    assert not {tuple(s) for s in hlo["all_gather_shapes"]} & big, step


def _worker(path: str) -> None:
  import checkpoints

  loaded = checkpoints.load_checkpoint(path)
  out = {"weight_shapes": sorted(stu.weight_shapes(loaded.params))}
  for name, tp in (("tp1", 1), ("tp4", 4)):
    runner = stu.make_runner(loaded, tp=tp, attention_backend="pallas_interpret")
    drv = stu.Driver(runner)
    tokens, first, dec = drv.generate(stu.PROMPTS, 3)
    out[name] = {"tokens": tokens, "logits": np.concatenate([first[None], dec]).tolist()}
  kv = runner.state.kv.k
  out.update(hlo={k: stu.hlo_collectives(v) for k, v in drv.hlo.items()},
             kv_shape=list(kv.shape), kv_shard_shape=list(kv.addressable_shards[0].data.shape))
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
