"""The rule table, partition specs, KV-head replication, mesh and distributed config.

Pure host checks on abstract meshes (no devices needed), so they run in the
main pytest process.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from serving.models.layout import param_shapes
from serving.models.model_config import ModelConfig
from sharding import ParallelConfig, make_mesh, rules
from sharding.distributed import DistributedConfig

LLAMA = ModelConfig(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
MOE = dataclasses.replace(LLAMA, model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32)


def mesh(tp=1, ep=1, dp=1, pp=1) -> AbstractMesh:
  return AbstractMesh((dp, pp, ep, tp), ("dp", "pp", "ep", "tp"),
                      axis_types=(AxisType.Auto,) * 4)


def test_every_param_has_logical_axes_of_its_rank():
  for cfg in (LLAMA, dataclasses.replace(MOE, qk_norm=True, qkv_bias=True)):
    shapes = param_shapes(cfg)
    for key, shape in {**shapes, **shapes["layers"]}.items():
      if key != "layers":
        stacked = key in shapes["layers"]
        assert len(rules.PARAM_AXES[key]) + stacked == len(shape), key
    assert set(rules.LOGICAL_AXIS_RULES) >= {n for a in rules.PARAM_AXES.values() for n in a}


def test_tp2_megatron_layout_stacked_and_per_layer():
  specs = rules.param_specs(param_shapes(LLAMA), LLAMA, mesh(tp=2))
  layers = specs["layers"]
  assert layers["wq"] == P(None, None, "tp") and layers["wo"] == P(None, "tp", None)
  assert layers["w_up"] == P(None, None, "tp") and layers["w_down"] == P(None, "tp", None)
  assert specs["embed"] == P("tp", None) and specs["lm_head"] == P(None, "tp")
  assert layers["attn_norm"] == P(None, None)
  per_layer = {**param_shapes(LLAMA), "layers": [{"wq": 0, "w_down": 0}] * 2}
  unrolled = rules.param_specs(per_layer, LLAMA, mesh(tp=2))["layers"]
  assert unrolled[1] == {"wq": P(None, "tp"), "w_down": P("tp", None)}
  assert rules.kv_cache_spec(LLAMA, mesh(tp=2)) == P(None, None, "tp", None)


def test_shard_what_divides():
  m8 = rules.resolve_rules(LLAMA, mesh(tp=8))
  assert m8["heads"] is None and m8["kv_heads"] is None  # 4 heads on 8 devices
  assert m8["vocab"] is None and m8["mlp"] == "tp"  # V=300; F=128
  moe = rules.resolve_rules(MOE, mesh(tp=2, ep=4))
  assert moe["expert"] == "ep" and moe["expert_mlp"] == "tp"
  assert rules.resolve_rules(MOE, mesh(ep=8))["expert"] is None  # 4 experts on 8
  assert rules.resolve_rules(LLAMA, mesh())["heads"] is None  # size-1 axes: no sharding


def test_kv_head_replication_keeps_gqa_groups():
  assert rules.kv_head_replicas(LLAMA, 2) == 1 and rules.kv_head_replicas(LLAMA, 4) == 2
  assert rules.kv_head_replicas(LLAMA, 8) == 1  # N=4 cannot split 8 ways
  wk = np.arange(2 * 3 * 2 * 16, dtype=np.float32).reshape(2, 3, 32)  # [L, D, K*H]
  params = {"layers": {"wk": wk, "wv": wk, "wq": np.zeros((2, 3, 64), np.float32)}}
  out, cfg = rules.replicate_kv_heads(params, LLAMA, 2)
  assert cfg.num_kv_heads == 4
  heads = out["layers"]["wk"].reshape(2, 3, 4, 16)
  src = wk.reshape(2, 3, 2, 16)
  for h in range(4):  # query head i used kv head i // 2; now kv head i // 1
    np.testing.assert_array_equal(heads[:, :, h], src[:, :, h // 2])
  assert rules.kv_cache_spec(cfg, mesh(tp=4)) == P(None, None, "tp", None)


def test_mesh_needs_enough_devices():
  one = jax.devices()[:1]
  with pytest.raises(ValueError, match="needs 2 devices but only 1"):
    make_mesh(ParallelConfig(tp=2), one)
  with pytest.raises(ValueError, match="tp=0"):
    ParallelConfig(tp=0)
  assert make_mesh(ParallelConfig(), one).shape == {"dp": 1, "pp": 1, "ep": 1, "tp": 1}
  with pytest.raises(ValueError, match=r"tp\*ep\*dp\*pp = 1\*1\*1\*2 = 2 needs 2 devices"):
    make_mesh(ParallelConfig(pp=2), one)


def test_pipeline_stages_split_layers_and_pages():
  specs = rules.param_specs(param_shapes(LLAMA), LLAMA, mesh(pp=2, tp=2))
  assert specs["layers"]["wq"] == P("pp", None, "tp")
  assert specs["layers"]["attn_norm"] == P("pp", None)
  assert specs["embed"] == P("tp", None)  # outside the stages: replicated over pp
  assert rules.kv_cache_spec(LLAMA, mesh(pp=2)) == P("pp", None, None, None)
  # A layer count pp does not divide stays whole (pipeline.pad_layers pads it first).
  assert rules.kv_cache_spec(LLAMA, mesh(pp=4)) == P(None, None, None, None)


def test_distributed_config_from_flags_and_env():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3"}
  cfg = DistributedConfig.resolve(None, env)
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("10.0.0.1:1234", 4, 3)
  assert not cfg.is_leader
  flags = {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
  assert DistributedConfig.resolve(flags, env).is_leader
  assert DistributedConfig.resolve(None, {}) == DistributedConfig()
  with pytest.raises(ValueError, match="coordinator_address"):
    DistributedConfig.resolve({"num_processes": 2, "process_id": 1}, {})
  with pytest.raises(ValueError, match="process_id=2"):
    DistributedConfig.resolve({"coordinator_address": "h:1", "num_processes": 2,
                               "process_id": 2}, {})
