"""Tiny random-weight Hugging Face models for tests (built with `transformers`).

`save_tiny_model(family, path)` writes a HF directory — config.json,
model.safetensors and a byte-level tokenizer.json — that every loader and
the engine accept; `transformers` is the numerical reference (`torch_greedy`).
"""

from __future__ import annotations

import json
import os

import numpy as np
import tokenizers
import torch
import transformers

from checkpoints.gguf_vocab import bytes_to_unicode
from serving.config import EngineConfig
from serving.entrypoints.engine_builder import build_engine
from serving.types import SamplingParams

VOCAB = 300  # 256 byte tokens + specials + spare ids

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)

# Phi-3's chat tokens after <s> and </s>: <|endoftext|> is the config's EOS, turns end with
# <|end|>; generation_config lists all three ends (as the published checkpoints do).
PHI3_SPECIALS = ("<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>")
PHI3_EOS = 258
PHI3_GENERATION_EOS = [258, 259, 260]
# Phi-4-mini's template (without tools).
PHI3_CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + "
                      "message['content'] + '<|end|>' }}{% endfor %}{% if add_generation_prompt "
                      "%}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
# Gemma: tied embeddings, EOS + <end_of_turn> (id 259), windows of 8 tokens (test prompts are
# longer), larger weights (initializer_range) so attention scores and logits reach the soft
# caps, query_pre_attn_scalar != head_dim.
_GEMMA = {**_COMMON, "tie_word_embeddings": True, "eos_token_id": [257, 259], "head_dim": 16,
          "sliding_window": 8, "query_pre_attn_scalar": 24, "initializer_range": 0.1}

_DEEPSEEK = dict(**{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
                 q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
                 topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32,
                 n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
_QWEN3_NEXT = {**_COMMON, "num_hidden_layers": 8, "head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "num_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32}

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON),
    "llama3": lambda: transformers.LlamaConfig(**{**_COMMON, "rope_theta": 500000.0}, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=16),
    "smollm2": lambda: transformers.LlamaConfig(**{**_COMMON, "tie_word_embeddings": True,
                                                   "num_attention_heads": 6,
                                                   "num_key_value_heads": 2,
                                                   "hidden_size": 96}),
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # Phi-4-mini's shape: RoPE on 3/4 of each head, LongRoPE (short set up to 128
    # positions), tied embeddings; plus a sliding window smaller than test prompts.
    "phi3": lambda: transformers.Phi3Config(
        **{**_COMMON, "tie_word_embeddings": True, "eos_token_id": PHI3_EOS}, pad_token_id=None,
        sliding_window=16,
        original_max_position_embeddings=128, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
                      "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]}),
    # Phi-3-mini-4k's shape: plain RoPE on whole heads, a sliding window.
    "phi3_mini": lambda: transformers.Phi3Config(**{**_COMMON, "eos_token_id": PHI3_EOS},
                                                 pad_token_id=None, sliding_window=16),
    # Sliding (window 8) / full layers alternating, sinks, biases everywhere, YaRN
    # (original 64 positions x factor 16 = max_position_embeddings), a SwiGLU clamp
    # (limit) small enough that random weights reach it; expert columns in two MXFP4
    # groups, so tp=2 splits whole groups.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**_COMMON, "intermediate_size": 64, "num_hidden_layers": 4}, head_dim=16,
        sliding_window=8, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=0.3,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64}),
    "gemma2": lambda: transformers.Gemma2Config(  # alternating sliding / full layers
        **{**_GEMMA, "num_hidden_layers": 4}, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(  # 5 sliding layers, then 1 full
        **{**_GEMMA, "num_hidden_layers": 6}, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}),
    # MLA (q LoRA, interleaved RoPE) over a latent cache of 32 + 8 per token per layer; one
    # dense layer, then routed experts in 4 groups (2 kept) plus a shared expert narrower
    # than the dense MLP.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(**_DEEPSEEK),
    # V2-Lite's shape (a direct q projection), rotate-half RoPE, YaRN with mscale_all_dim
    # (the softmax scale) and no shared experts.
    "deepseek_v3_yarn": lambda: transformers.DeepseekV3Config(**{
        **_DEEPSEEK, "q_lora_rank": None, "rope_interleave": False, "n_shared_experts": 0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 256, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}}),
    # Qwen3-Next: blocks of 3 Gated DeltaNet layers then 1 gated full-attention layer
    # (2 blocks), 2 key / 4 value heads in the linear layers, RoPE on a quarter of each
    # head; MoE with a shared expert, or a dense MLP.
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**_QWEN3_NEXT),
    "qwen3_next_dense": lambda: transformers.Qwen3NextConfig(**{**_QWEN3_NEXT,
                                                                "num_experts": 0}),
    # Qwen3.5 text: the same blocks, separate linear projections, dense MLP.
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**{
        k: v for k, v in _QWEN3_NEXT.items() if "expert" not in k}),
}
# The families the model-independent sweeps (LoRA parity, draft-model speculation) run
# over: each family's code path once (gemma2 shares gemma3's, phi3_mini phi3's; their own
# parity and feature tests cover what differs).
# Families with their own tests only: DeepSeek (MLA: no LoRA on its projections, no
# draft-model pairing); Qwen3-Next's linear-attention state slots refuse LoRA and
# speculation.
SWEEP_FAMILIES = tuple(sorted(set(FAMILIES) - {"gemma2", "phi3_mini", "deepseek_v3",
                                               "deepseek_v3_yarn", "qwen3_next",
                                               "qwen3_next_dense", "qwen3_5"}))
# Parameters (name fragment -> noise scale) `save_tiny_model` randomises, so the tests
# exercise them: norms everywhere; GPT-OSS's zero-initialised biases and its sinks
# (large enough to take a real share of each softmax).
_RANDOMISED = {"gpt_oss": {"norm": 0.1, "sinks": 1.0, "bias": 0.1}}
# Buffers randomised too: DeepSeek's routing correction bias (zeros as initialised).
_RANDOMISED_BUFFERS = {"e_score_correction_bias": 0.1}
# Extra special tokens and the checkpoint's chat template (tests/data) per family.
_CHAT = {
    "gemma2": (["<start_of_turn>", "<end_of_turn>"], "gemma2_chat_template.jinja"),
    "gemma3": (["<start_of_turn>", "<end_of_turn>"], "gemma3_chat_template.jinja"),
}
_DEFAULT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                     "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def byte_tokenizer(extra_specials: tuple[str, ...] | list[str] = ()) -> tokenizers.Tokenizer:
  """A byte-level BPE with no merges: one token per byte, plus <s>, </s> and `extra_specials`
  (ids 258...)."""
  alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
  vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                          use_regex=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.add_special_tokens(["<s>", "</s>", *extra_specials])
  return tok


def _byte_of(ch: str) -> int:
  return {v: k for k, v in bytes_to_unicode().items()}[ch]


def save_tiny_model(family: str, path: str, seed: int = 0) -> transformers.PreTrainedModel:
  """Writes a tiny random model of `family` to `path`; returns the torch model (f32, eval)."""
  torch.manual_seed(seed)
  config = FAMILIES[family]()
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():  # random norms, so RMSNorm weights are exercised too
    for name, p in model.named_parameters():
      for part, scale in _RANDOMISED.get(family, {"norm": 0.1}).items():
        if part in name:
          p.add_(scale * torch.randn_like(p))
    for name, b in model.named_buffers():
      for part, scale in _RANDOMISED_BUFFERS.items():
        if part in name:
          b.add_(scale * torch.randn_like(b))
  model.save_pretrained(path)
  if config.model_type == "phi3":
    _write_phi3_tokenizer(path)
    return model
  specials, template_file = _CHAT.get(family, ((), None))
  template = _DEFAULT_TEMPLATE
  if template_file is not None:
    with open(os.path.join(os.path.dirname(__file__), "data", template_file)) as f:
      template = f.read()
  byte_tokenizer(specials).save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
               "chat_template": template}, f)
  return model


def _write_phi3_tokenizer(path: str) -> None:
  """Phi-3's chat files: its special tokens, template and generation_config EOS list."""
  tok = byte_tokenizer()
  tok.add_special_tokens(list(PHI3_SPECIALS))
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "<|endoftext|>", "add_bos_token": False,
               "chat_template": PHI3_CHAT_TEMPLATE}, f)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"bos_token_id": 256, "eos_token_id": PHI3_GENERATION_EOS}, f)


def torch_greedy(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
  """n greedy tokens of a torch model (no KV cache, no EOS handling) and the first
  step's log-probs (float64): the reference the engine's output is compared with."""
  ids, first = list(prompt), None
  with torch.no_grad():
    for _ in range(n):
      logits = model(torch.tensor([ids])).logits[0, -1].double()
      if first is None:
        first = torch.log_softmax(logits, -1).numpy()
      ids.append(int(torch.argmax(logits)))
  return ids[len(prompt):], first


def run_requests(engine, prompts: list[list[int]], params) -> list[tuple[list[int], list, str]]:
  """Every prompt added to `engine` at once, run to the end -> per prompt (token ids,
  logprobs, finish reason)."""
  results = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    engine.add_request(f"r{i}", p, params, results[i].append)
  engine.run_until_idle()
  return [(sum((o.token_ids for o in outs), []), sum((o.logprobs or [] for o in outs), []),
           outs[-1].finish_reason) for outs in results.values()]


def greedy_alone(model_dir: str, engine: dict, prompts: list[str], max_tokens: int
                 ) -> dict[str, tuple[str, list[int]]]:
  """Each prompt generated alone, greedily, by one in-process engine of `engine`'s
  options -> prompt: (text, token ids): what servers built from the same options must
  return."""
  one = build_engine(model_dir, EngineConfig.of(**engine, compilation_cache=False))
  out = {}
  for i, p in enumerate(prompts):
    got = []
    one.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True), got.append)
    one.run_until_idle()
    out[p] = ("".join(o.text for o in got), [t for o in got for t in o.token_ids])
  return out


def assert_matches_torch(model, prompts: list[list[int]], outs, n: int, tol: float) -> None:
  """`run_requests` outputs (greedy, `n` tokens, top logprobs) against the torch model:
  tokens identical, the first step's top logprobs within `tol` of its log-softmax."""
  for prompt, (tokens, logprobs, reason) in zip(prompts, outs, strict=True):
    ref_tokens, ref_lp = torch_greedy(model, prompt, n)
    assert reason == "length"
    assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
    first = logprobs[0]
    top_ids = [i for i, _ in first.top]
    np.testing.assert_allclose([lp for _, lp in first.top], ref_lp[top_ids], atol=tol)
    assert top_ids[0] == int(np.argmax(ref_lp))
    assert abs(first.logprob - ref_lp[tokens[0]]) < tol
