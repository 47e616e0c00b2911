"""Qwen3-Next's state slots through the real runner: preemption, a failed step's
rollback, no compiles after warm-up, the capacity line, and the refusals.

The tiny model (tests/tiny_models.py) serves prompts shorter and longer than the
32-token prefill chunk on a pool small enough to preempt, while one request's step
fails after it ran on the device (`fail_at="fetch"`: its sequences' states were
written, and the next step was already in flight): the blameless requests are
rolled back and recomputed from zero states and must still give transformers'
greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from compile_watch import compile_events
from runner_faults import FaultyRunner

from checkpoints import load_checkpoint
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.models import qwen3_next
from serving.runner.model_runner import ModelRunner
from serving.runner.state_cache import check_engine
from serving.types import SamplingParams
from tiny_models import VOCAB, save_tiny_model, torch_greedy

TOKENS = 24


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=96, page_size=4, num_pages=40,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen3_next"))
  model = save_tiny_model("qwen3_next", path)
  return load_checkpoint(path), model


def _run(engine, prompts, params):
  outs = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, outs[i].append)
  engine.run_until_idle()
  return [(sum((o.token_ids for o in outs[i]), []), outs[i][-1].finish_reason) for i in outs]


@pytest.mark.slow
def test_preemption_and_a_failed_step_keep_transformers_tokens(tiny):
  loaded, model = tiny
  config = engine_config()
  fired = []

  def once(seq) -> bool:  # r1's step fails once, when fetched (the next one in flight)
    if seq.request_id == "r1" and seq.num_generated >= 2 and not fired:
      fired.append(seq)
      return True
    return False

  runner = FaultyRunner(ModelRunner.from_params(loaded.params, loaded.config, config),
                        fail_request=once, fail_at="fetch")
  engine = LLMEngine(runner=runner, tokenizer=loaded.tokenizer, config=config)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 9, 45, 60)]
  params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
  with compile_events() as events:
    got = _run(engine, prompts, params)
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  assert fired and got[1][1] == "error"
  for i in (0, 2, 3):
    assert got[i] == (torch_greedy(model, prompts[i], TOKENS)[0], "length"), i
  stats = engine.stats()
  assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total == 0


def test_the_capacity_line_reports_per_sequence_state_bytes(tiny, capsys):
  loaded, _ = tiny
  ModelRunner.from_params(loaded.params, loaded.config, engine_config())
  # 2 blocks x 3 linear layers; per layer float32 conv inputs (kernel 4 - 1) x (2 key heads
  # x 2 x 8 + 4 value heads x 12) and recurrent state 4 heads x 8 x 12.
  per_seq = 4 * 2 * 3 * (3 * (2 * 2 * 8 + 4 * 12) + 4 * 8 * 12)
  assert loaded.config.state_bytes_per_sequence() == per_seq == 14976
  assert f"linear-attention state {per_seq} B/sequence (6 layers) x 5 slots" in (
      capsys.readouterr().err)


RAW = dict(num_hidden_layers=4, vocab_size=300, hidden_size=64, num_attention_heads=4,
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=0)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "mamba", "linear_attention", "full_attention"]),
     r"unsupported layer type\(s\) \['mamba'\]"),
    (dict(layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 2),
     "unsupported layer pattern"),
    (dict(linear_key_head_dim=None), "missing 'linear_key_head_dim'"),
    (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
          shared_expert_intermediate_size=8, mlp_only_layers=[1]), "MLP layout"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
  with pytest.raises(ValueError, match=message):
    qwen3_next.config_from_hf({**RAW, **change})


def test_full_attention_interval_gives_the_blocks():
  cfg = qwen3_next.config_from_hf({**RAW, "num_hidden_layers": 6, "full_attention_interval": 3})
  assert (cfg.num_layers, cfg.linear_layers_per_block) == (2, 2)


@pytest.mark.parametrize("option,name", [
    (dict(speculative_method="ngram", num_speculative_tokens=3), "speculative decoding"),
    (dict(max_loras=1), "LoRA adapters")])
def test_engine_options_without_state_rollback_are_refused(option, name):
  cfg = qwen3_next.config_from_hf(RAW)
  with pytest.raises(ValueError, match=name):
    check_engine(cfg, engine_config(**option))


def test_qwen3_5_multimodal_checkpoints_load_the_language_model_only():
  cfg = qwen3_next.config_from_hf({**RAW, "model_type": "qwen3_5_text", "num_hidden_layers": 8})
  assert (cfg.family, cfg.num_experts, cfg.num_layers) == ("qwen3_next", 0, 2)
  b = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)
  assert qwen3_next.hf_tensors(cfg, "model.visual.blocks.0.attn.qkv.weight", b) == []
  assert qwen3_next.hf_tensors(cfg, "mtp.fc.weight", b) == []
  [(key, index, value)] = qwen3_next.hf_tensors(
      cfg, "model.language_model.layers.5.linear_attn.in_proj_b.weight", b)
  assert (key, index) == ("lin_b", (1, 1)) and np.array_equal(value, b.T)


@pytest.mark.parametrize("experts", [0, 4])
def test_every_param_has_logical_axes_of_its_rank(experts):
  from serving.models.layout import param_shapes
  from sharding import rules

  cfg = qwen3_next.config_from_hf({**RAW, "num_experts": experts, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 8,
                                   "shared_expert_intermediate_size": 8})
  shapes = param_shapes(cfg)
  for key, shape in shapes["layers"].items():
    assert len(rules.PARAM_AXES[key]) + 1 == len(shape), key
  assert set(rules.LOGICAL_AXIS_RULES) >= {n for a in rules.PARAM_AXES.values() for n in a}


def test_the_loader_takes_fused_experts_and_names_a_missing_tensor(tiny):
  from checkpoints import hf_qwen3_next

  loaded, model = tiny
  state = {k: v.detach().numpy() for k, v in model.state_dict().items()}  # fused experts
  assert "model.layers.0.mlp.experts.gate_up_proj" in state
  files = [(k, lambda v=v: v) for k, v in state.items()]
  params = hf_qwen3_next.load_params(files, loaded.config)
  for key, leaf in params["layers"].items():
    np.testing.assert_array_equal(leaf, loaded.params["layers"][key], err_msg=key)
  with pytest.raises(ValueError, match="missing tensors for \\['lin_conv'\\]"):
    hf_qwen3_next.load_params([f for f in files if f[0] != "model.layers.5.linear_attn.conv1d"
                               ".weight"], loaded.config)
