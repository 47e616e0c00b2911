"""An orbax checkpoint saved from a tp=2 mesh restores onto tp=4 with identical outputs.

The worker (8 simulated CPU devices) serves a tiny Llama at tp=2, saves the
runner's sharded params with `checkpoints.sharded.save_sharded`, restores
them with `restore_sharded` straight onto a tp=4 mesh (each device reads
its own slice), checks the restored shardings, and serves again at tp=4.
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
  return stu.run_worker(__file__, path, str(tmp_path_factory.mktemp("orbax")))


def test_restored_onto_tp4(result):
  assert result["wq_spec"] == "P(None, None, 'tp')"
  assert result["wq_devices"] == 4
  assert result["wq_shard_shape"] == [2, 64, 16]  # [L, D, N*H / 4]
  assert result["values_equal"]


def test_hf_read_per_device_block(result):
  assert result["hf_sliced_equal"]  # checkpoints.hf_sharded onto the tp=4 mesh


def test_outputs_identical(result):
  assert result["tp4"]["tokens"] == result["tp2"]["tokens"]
  np.testing.assert_allclose(result["tp4"]["logits"], result["tp2"]["logits"],
                             atol=stu.LOGIT_ATOL)


def _serve(runner) -> dict:
  tokens, first, dec = stu.Driver(runner).generate(stu.PROMPTS, 5)
  return {"tokens": tokens, "logits": np.concatenate([first[None], dec]).tolist()}


def _worker(hf_path: str, out_dir: str) -> None:
  import jax

  import checkpoints
  from checkpoints.sharded import restore_sharded, save_sharded
  from sharding import ParallelConfig, make_mesh

  loaded = checkpoints.load_checkpoint(hf_path)
  runner2 = stu.make_runner(loaded, tp=2)
  out = {"tp2": _serve(runner2)}
  save_sharded(runner2.params, runner2.model_cfg, out_dir, loaded.tokenizer)
  restored = restore_sharded(out_dir, make_mesh(ParallelConfig(tp=4)))
  wq = restored.params["layers"]["wq"]
  out.update(wq_spec=str(wq.sharding.spec), wq_devices=len(wq.sharding.device_set),
             wq_shard_shape=list(wq.addressable_shards[0].data.shape),
             values_equal=all(jax.tree.leaves(jax.tree.map(
                 lambda a, b: bool(np.array_equal(np.asarray(a), b)), restored.params,
                 loaded.params))))
  out["tp4"] = _serve(stu.make_runner(restored, tp=4))
  out["hf_sliced_equal"] = stu.hf_sliced_equal(hf_path, loaded, ParallelConfig(tp=4))
  stu.emit(out)


if __name__ == "__main__":
  stu.worker_setup()
  _worker(*sys.argv[1:])
