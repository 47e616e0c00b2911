"""Hybrid attention on the device: two KV page groups, pages released behind the window.

A tiny random-weight Qwen2 with alternating full / sliding-window layers
(transformers' `layer_types`, window 16 tokens) is the model: the real engine
serves it with the sliding layers in their own page group (kv_cache.KVLayout),
whose pages behind the window are released and handed to other requests, and
its greedy tokens and first logprobs must equal transformers' on prompts and
outputs several windows long. The same model with the window spanning
max_model_len is served as full attention (one group, a log line). The
capacity functions count both groups' bytes.
"""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import torch
import transformers
from compile_watch import compile_events

from checkpoints import load_checkpoint
from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.runner import model_runner
from serving.runner.kv_cache import kv_layout, window_group_pages
from serving.types import SamplingParams
from tiny_models import VOCAB, byte_tokenizer, torch_greedy

WINDOW = 16
LAYER_TYPES = ["full_attention", "sliding_attention"] * 2


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
  """(the loaded checkpoint, torch model) of the tiny hybrid Qwen2."""
  path = str(tmp_path_factory.mktemp("qwen2_hybrid"))
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False, use_sliding_window=True,
      sliding_window=WINDOW, layer_types=LAYER_TYPES)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  model.save_pretrained(path)
  byte_tokenizer().save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)
  loaded = load_checkpoint(path)
  # The layer kinds as transformers reads them (the family's config parser may not yet).
  config = dataclasses.replace(loaded.config, layer_types=tuple(LAYER_TYPES))
  assert config.is_hybrid
  return dataclasses.replace(loaded, config=config), model


def engine_config(**kw) -> EngineConfig:
  base = dict(max_num_seqs=4, max_model_len=160, page_size=4, num_pages=120,
              max_num_batched_tokens=32, attention_block_tokens=16, unroll_layers=False,
              attention_backend="xla", compilation_cache=False)
  return EngineConfig.of(**{**base, **kw})


def test_transformers_sees_a_hybrid_model(hybrid_model):
  """The reference itself: its sliding layers mask (a full-attention twin differs)."""
  _, model = hybrid_model
  prompt = list(range(1, 60))
  twin = transformers.AutoModelForCausalLM.from_config(
      transformers.Qwen2Config(**{**model.config.to_dict(), "use_sliding_window": False,
                                  "layer_types": ["full_attention"] * 4})).eval()
  twin.load_state_dict(model.state_dict())
  with torch.no_grad():
    a = model(torch.tensor([prompt])).logits[0, -1]
    b = twin(torch.tensor([prompt])).logits[0, -1]
  assert not torch.allclose(a, b, atol=1e-3)


def run(engine, prompts, params):
  outs = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, outs[i].append)
  most = 0
  while engine.has_unfinished():
    engine.step()
    alloc = engine.window.allocator
    most = max(most, alloc.num_usable - alloc.num_free)
  return [sum((o.token_ids for o in v), []) for v in outs.values()], outs, most


def test_hybrid_engine_matches_transformers_and_releases_window_pages(hybrid_model):
  loaded, model = hybrid_model
  engine = build_engine(loaded, engine_config())
  layout = engine.runner.kv_layout
  assert layout is not None and layout.sliding == (False, True, False, True)
  assert engine.window is not None and engine.window.window == WINDOW
  full_pages, window_pages = layout.num_pages, layout.window_pages
  assert window_pages < full_pages
  kv = engine.runner.state.kv
  assert kv.k.shape[0] == 2 * full_pages + 2 * window_pages
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 41, 70)]  # 70: 3 chunks
  params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=5)
  tokens, outs, most = run(engine, prompts, params)
  for i, prompt in enumerate(prompts):
    ref, ref_lp = torch_greedy(model, prompt, 64)
    assert tokens[i] == ref, f"prompt {i}"
    first = outs[i][0].logprobs[0]
    np.testing.assert_allclose([lp for _, lp in first.top], ref_lp[[t for t, _ in first.top]],
                               atol=1e-4)
  # Three sequences of up to 134 tokens: their full pages, but only their windows.
  ps = engine.config.cache.page_size
  per_seq = -(-WINDOW // ps) + 1
  budget = 2 * -(-engine.config.scheduler.max_num_batched_tokens // ps)
  assert 0 < most <= 3 * per_seq + budget
  for alloc in (engine.allocator, engine.window.allocator):
    alloc.check()
    assert alloc.num_free == alloc.num_usable


@pytest.mark.parametrize("options", [
    pytest.param({}, id="plain"),
    pytest.param(dict(num_decode_steps=4), id="multi_step", marks=pytest.mark.slow),
    pytest.param(dict(speculative_method="ngram", num_speculative_tokens=3), id="ngram",
                 marks=pytest.mark.slow)])
def test_prefix_hits_and_preemption_keep_the_hybrid_output(hybrid_model, options):
  """A shared prefix longer than the window, a pool small enough to preempt, decoding
  ahead (multi-step, drafts): every request still gets transformers' tokens, and
  nothing compiles after warm-up."""
  loaded, model = hybrid_model
  engine = build_engine(loaded, engine_config(num_pages=40, max_num_seqs=4, **options))
  rng = np.random.default_rng(1)
  system = rng.integers(0, VOCAB, 36).tolist()
  prompts = [system + rng.integers(0, VOCAB, 3 + i).tolist() for i in range(4)]
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  with compile_events() as events:
    first, _, _ = run(engine, prompts[:1], params)  # publishes the prefix
    tokens, _, _ = run(engine, prompts, params)
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  assert tokens[0] == first[0]
  for prompt, got in zip(prompts, tokens, strict=True):
    assert got == torch_greedy(model, prompt, 40)[0]
  stats = engine.stats()
  assert stats.prefix_cache_hits_total > 0 and stats.num_preemptions_total > 0


def test_a_window_spanning_max_model_len_is_served_as_full_attention(hybrid_model, caplog):
  loaded, model = hybrid_model
  with caplog.at_level(logging.INFO, logger="serving.runner.model_runner"):
    engine = build_engine(loaded, engine_config(max_model_len=WINDOW))
  assert engine.runner.kv_layout is None and engine.window is None
  assert "served as full attention" in caplog.text
  prompt = list(range(3, 10))
  tokens, _, _ = run_plain(engine, prompt, 8)
  assert tokens == torch_greedy(model, prompt, 8)[0]


def run_plain(engine, prompt, n):
  outs = []
  engine.add_request("x", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                 ignore_eos=True), outs.append)
  engine.run_until_idle()
  return sum((o.token_ids for o in outs), []), outs, 0


def test_capacity_counts_both_groups(hybrid_model):
  """The pages a budget buys: full pages plus the window group they imply fit it, one
  more full page does not."""
  loaded, _ = hybrid_model
  cfg = loaded.config
  config = engine_config(num_pages=None, max_num_seqs=2, max_model_len=1024)
  full, sliding = model_runner._group_page_bytes(cfg, config, "float32")
  per_layer = 4 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # page, k+v, heads, dim, float32
  assert (full, sliding) == (2 * per_layer, 2 * per_layer)
  for budget in (3e5, 3e6, 3e7):
    pages = model_runner._pages_within(budget, [full, sliding], cfg, config)
    layout = kv_layout(cfg, config, pages)
    assert layout.window_pages == window_group_pages(WINDOW, config, pages)
    assert pages * full + layout.window_pages * sliding <= budget
    more = kv_layout(cfg, config, pages + 1)
    assert (pages + 1) * full + more.window_pages * sliding > budget
