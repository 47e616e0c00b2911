"""Decode speed of a tiny random DeepSeek-V3 (MLA over a latent cache, MoE) against a
tiny Llama of the same width, depth and heads (plain per-head K/V pages), through
the engine on this machine's default backend.

Both models: hidden 64, 3 layers, 4 heads, vocabulary 300, float32 (DeepSeek: q LoRA
48, latent 32 + rope 8, 8 routed experts of 32 (2 per token) + a shared one, the first
layer dense 128; Llama: 4 KV heads of 16, MLP 128). Per round, each engine serves
`--batch` requests of `--input_len` random tokens and `--output_len` greedy tokens
(ignore_eos); decode tokens/s = batch * (output_len - 1) / (wall time - the time of
a run with output_len 1, the prefill and first token). Rounds alternate the models
after a warm-up of each; the median is printed. Timings on a shared machine are
noisy: compare only within one run.

  python benchmarks/mla_decode_speed.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import tiny_models  # noqa: E402  (the tests' byte-level tokenizer)
from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.runner.kv_cache import kv_bytes_per_token
from serving.types import SamplingParams

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
              bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **COMMON, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1),
    "llama": lambda: transformers.LlamaConfig(**COMMON),
}


def _save(name: str) -> str:
  path = tempfile.mkdtemp(prefix=f"mla_speed_{name}_")
  torch.manual_seed(0)
  transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).save_pretrained(path)
  tiny_models.byte_tokenizer().save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)
  return path


def _run(engine, prompts, output_len: int) -> float:
  params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
  for i, p in enumerate(prompts):
    engine.add_request(f"r{time.perf_counter_ns()}_{i}", p, params, lambda out: None)
  t0 = time.perf_counter()
  engine.run_until_idle()
  return time.perf_counter() - t0


def main() -> None:
  """Builds both engines, alternates timed rounds, prints decode tokens/s (module doc)."""
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--input_len", type=int, default=32)
  ap.add_argument("--output_len", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=5)
  a = ap.parse_args()
  max_len = -(-(a.input_len + a.output_len + 1) // 16) * 16
  config = EngineConfig.of(max_num_seqs=a.batch, max_model_len=max_len, page_size=16,
                           max_num_batched_tokens=256, compilation_cache=False)
  engines = {name: build_engine(_save(name), config) for name in CONFIGS}
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, a.input_len).tolist() for _ in range(a.batch)]
  for engine in engines.values():  # warm-up
    _run(engine, prompts, a.output_len)
  rates = {name: [] for name in engines}
  for _ in range(a.rounds):
    for name, engine in engines.items():
      first = _run(engine, prompts, 1)
      whole = _run(engine, prompts, a.output_len)
      rates[name].append(a.batch * (a.output_len - 1) / max(whole - first, 1e-9))
  for name, engine in engines.items():
    per_token = kv_bytes_per_token(engine.runner.model_cfg, engine.runner.kv_dtype_name)
    print(f"{name:12s} decode {statistics.median(rates[name]):8.1f} tok/s (median of "
          f"{a.rounds}; all {[round(r) for r in rates[name]]}), KV {per_token} B/token")


if __name__ == "__main__":
  main()
