"""Helpers for checkpoint tests: tiny transformers models and GGUF files built from them."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers

from checkpoints.gguf_vocab import bytes_to_unicode

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=261, max_position_embeddings=256)
MOE = dict(num_experts_per_tok=2)
# model_type -> (config class, extra config kwargs)
ARCHS = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, **MOE}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 48,
                                                "decoder_sparse_step": 1, "mlp_only_layers": [],
                                                **MOE}),
    "phi3": (transformers.Phi3Config, {
        "pad_token_id": None, "sliding_window": 16, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.4, 1.8, 2.5],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Phi-3's vocabulary ends: <|endoftext|> (EOS) and <|end|> (end of a turn).
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|end|>"]


def tiny_model(model_type: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
  """A random-weight causal LM of `model_type` (float32, eval mode)."""
  cls, extra = ARCHS[model_type]
  torch.manual_seed(seed)
  cfg = cls(**{**TINY, **extra, **overrides})
  model = transformers.AutoModelForCausalLM.from_config(cfg)
  with torch.no_grad():  # norms default to ones: make them distinguishable
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(torch.rand_like(p) + 0.5)
  return model.eval()


def expected_params(model: transformers.PreTrainedModel) -> dict:
  """The params tree (docs/structure.md) derived from the in-memory torch weights."""
  cfg = model.config
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  L = cfg.num_hidden_layers
  layer = lambda i, name: sd[f"model.layers.{i}.{name}"]
  stack = lambda fn: np.stack([fn(i) for i in range(L)])
  lin = lambda name: stack(lambda i: layer(i, name).T)
  p = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
  if not cfg.tie_word_embeddings:
    p["lm_head"] = sd["lm_head.weight"].T
  if "model.layers.0.self_attn.qkv_proj.weight" in sd:
    _split_phi3_fused(sd, cfg)
  lp = {"attn_norm": stack(lambda i: layer(i, "input_layernorm.weight")),
        "mlp_norm": stack(lambda i: layer(i, "post_attention_layernorm.weight")),
        "wq": lin("self_attn.q_proj.weight"), "wk": lin("self_attn.k_proj.weight"),
        "wv": lin("self_attn.v_proj.weight"), "wo": lin("self_attn.o_proj.weight")}
  if "model.layers.0.self_attn.q_proj.bias" in sd:
    for n in "qkv":
      lp[f"b{n}"] = stack(lambda i, n=n: layer(i, f"self_attn.{n}_proj.bias"))
  if "model.layers.0.self_attn.q_norm.weight" in sd:
    lp["q_norm"] = stack(lambda i: layer(i, "self_attn.q_norm.weight"))
    lp["k_norm"] = stack(lambda i: layer(i, "self_attn.k_norm.weight"))
  if "model.layers.0.mlp.experts.gate_up_proj" in sd:  # transformers 5 fused experts
    gate_up = stack(lambda i: layer(i, "mlp.experts.gate_up_proj"))  # [L, E, 2M, D]
    m = gate_up.shape[2] // 2
    lp["router"] = lin("mlp.gate.weight")
    lp["we_gate"] = gate_up[:, :, :m].transpose(0, 1, 3, 2)
    lp["we_up"] = gate_up[:, :, m:].transpose(0, 1, 3, 2)
    lp["we_down"] = stack(lambda i: layer(i, "mlp.experts.down_proj")).transpose(0, 1, 3, 2)
  else:
    lp.update(w_gate=lin("mlp.gate_proj.weight"), w_up=lin("mlp.up_proj.weight"),
              w_down=lin("mlp.down_proj.weight"))
  p["layers"] = lp
  return p


def _split_phi3_fused(sd: dict, cfg) -> None:
  """Adds the separate projections Phi-3's fused rows hold (q, k, v; gate, up) to `sd`."""
  head_dim = cfg.hidden_size // cfg.num_attention_heads
  q, k = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
  f = cfg.intermediate_size
  for i in range(cfg.num_hidden_layers):
    pre = f"model.layers.{i}."
    qkv, gate_up = sd[pre + "self_attn.qkv_proj.weight"], sd[pre + "mlp.gate_up_proj.weight"]
    sd[pre + "self_attn.q_proj.weight"] = qkv[:q]
    sd[pre + "self_attn.k_proj.weight"] = qkv[q:q + k]
    sd[pre + "self_attn.v_proj.weight"] = qkv[q + k:]
    sd[pre + "mlp.gate_proj.weight"], sd[pre + "mlp.up_proj.weight"] = gate_up[:f], gate_up[f:]


def assert_params_equal(ours: dict, expected: dict, atol: float = 0.0) -> None:
  assert set(ours) == set(expected)
  assert set(ours["layers"]) == set(expected["layers"])
  for key in expected:
    if key != "layers":
      np.testing.assert_allclose(ours[key], expected[key], rtol=0, atol=atol, err_msg=key)
  for key, want in expected["layers"].items():
    got = ours["layers"][key]
    assert got.shape == want.shape, key
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"layers.{key}")


# -- GGUF writing ---------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (rotate-half -> interleaved)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def llama_cpp_rope_factors(cfg) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf `rope_freqs` for Llama-3 rope scaling (its loop, verbatim)."""
  import math
  rp = cfg.rope_parameters
  base, dim = rp["rope_theta"], cfg.head_dim
  freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
  factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
  old_context_len = rp["original_max_position_embeddings"]
  low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
  rope_factors = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      rope_factors.append(1)
    elif wavelen > low_freq_wavelen:
      rope_factors.append(factor)
    else:
      smooth = (old_context_len / wavelen - low) / (high - low)
      rope_factors.append(1 / ((1 - smooth) / factor + smooth))
  return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def byte_vocab(specials: list[str] = SPECIALS) -> tuple[list[str], list[int], list[str]]:
  """A 261-token byte-level vocabulary: 256 bytes, 3 control tokens, 2 merges."""
  tokens = list(bytes_to_unicode().values()) + specials + ["Ġt", "he"]
  types = [1] * 256 + [3] * len(specials) + [1, 1]
  return tokens, types, ["Ġ t", "h e"]


def add_tokenizer(w: gguf.GGUFWriter, pre: str = "gpt-2", specials: list[str] = SPECIALS,
                  bos: str = "<|im_start|>", eos: str = "<|im_end|>") -> None:
  tokens, types, merges = byte_vocab(specials)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(tokens.index(bos))
  w.add_eos_token_id(tokens.index(eos))
  w.add_add_bos_token(False)


def gguf_from_model(model: transformers.PreTrainedModel, path: str, arch: str,
                    split_max_tensors: int = 0, chat_template: str | None = None) -> None:
  """Writes `model` as an F32 GGUF the way llama.cpp's converter lays it out."""
  cfg = model.config
  sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
  w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
  _add_arch_metadata(w, arch, cfg)
  if arch == "phi3":
    add_tokenizer(w, specials=PHI3_SPECIALS, bos="<|endoftext|>", eos="<|endoftext|>")
  else:
    add_tokenizer(w)
  if chat_template is not None:
    w.add_chat_template(chat_template)
  w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
  w.add_tensor("output_norm.weight", sd["model.norm.weight"])
  if (cfg.rope_parameters or {}).get("rope_type") == "llama3":
    w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(cfg))
  if arch == "phi3":
    _add_phi3(w, cfg)
  if not cfg.tie_word_embeddings:
    w.add_tensor("output.weight", sd["lm_head.weight"])
  for i in range(cfg.num_hidden_layers):
    for name, value in _block_tensors(sd, i, cfg, arch):
      w.add_tensor(f"blk.{i}.{name}", np.ascontiguousarray(value))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _add_phi3(w: gguf.GGUFWriter, cfg) -> None:
  """What llama.cpp's convert_hf_to_gguf `Phi3MiniModel` adds: the original context,
  the rotary dims, the sliding window (0: none) and, with LongRoPE, the attention
  factor and the two factor tensors."""
  rp = cfg.rope_parameters
  orig, max_pos = rp["original_max_position_embeddings"], cfg.max_position_embeddings
  w.add_uint32("phi3.rope.scaling.original_context_length", orig)
  rope_dims = int(rp.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // (
      cfg.num_attention_heads)
  w.add_uint32("phi3.rope.dimension_count", rope_dims)
  w.add_uint32("phi3.attention.sliding_window", cfg.sliding_window or 0)
  if rp.get("long_factor"):
    import math
    scale = max_pos / orig
    w.add_float32("phi3.rope.scaling.attn_factor",
                  math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], np.float32))


def _add_arch_metadata(w: gguf.GGUFWriter, arch: str, cfg) -> None:
  heads = cfg.num_attention_heads
  w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
  w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
  w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
  w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
  w.add_uint32(f"{arch}.attention.head_count", heads)
  w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
  w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
  w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
  w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
  if arch != "phi3":  # llama.cpp's Phi-3 converter writes its own rope dims, no key_length
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
  experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
  if experts:
    w.add_uint32(f"{arch}.expert_count", experts)
    w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    moe_f = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    w.add_uint32(f"{arch}.expert_feed_forward_length", moe_f)


def _block_tensors(sd: dict, i: int, cfg, arch: str):
  g = lambda name: sd[f"model.layers.{i}.{name}"]
  if arch == "phi3":  # fused tensors as stored: attn_qkv (q, k, v rows), ffn_up (gate, up)
    yield "attn_norm.weight", g("input_layernorm.weight")
    yield "ffn_norm.weight", g("post_attention_layernorm.weight")
    yield "attn_qkv.weight", g("self_attn.qkv_proj.weight")
    yield "attn_output.weight", g("self_attn.o_proj.weight")
    yield "ffn_up.weight", g("mlp.gate_up_proj.weight")
    yield "ffn_down.weight", g("mlp.down_proj.weight")
    return
  heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
  q, k = g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight")
  if arch == "llama":
    q, k = llama_cpp_permute(q, heads), llama_cpp_permute(k, kv)
  yield "attn_norm.weight", g("input_layernorm.weight")
  yield "ffn_norm.weight", g("post_attention_layernorm.weight")
  yield "attn_q.weight", q
  yield "attn_k.weight", k
  yield "attn_v.weight", g("self_attn.v_proj.weight")
  yield "attn_output.weight", g("self_attn.o_proj.weight")
  for n in "qkv":
    if f"model.layers.{i}.self_attn.{n}_proj.bias" in sd:
      yield f"attn_{n}.bias", g(f"self_attn.{n}_proj.bias")
  if f"model.layers.{i}.self_attn.q_norm.weight" in sd:
    yield "attn_q_norm.weight", g("self_attn.q_norm.weight")
    yield "attn_k_norm.weight", g("self_attn.k_norm.weight")
  if f"model.layers.{i}.mlp.experts.gate_up_proj" in sd:
    gate_up = g("mlp.experts.gate_up_proj")  # [E, 2M, D]
    m = gate_up.shape[1] // 2
    yield "ffn_gate_inp.weight", g("mlp.gate.weight")
    yield "ffn_gate_exps.weight", gate_up[:, :m]
    yield "ffn_up_exps.weight", gate_up[:, m:]
    yield "ffn_down_exps.weight", g("mlp.experts.down_proj")
  else:
    yield "ffn_gate.weight", g("mlp.gate_proj.weight")
    yield "ffn_up.weight", g("mlp.up_proj.weight")
    yield "ffn_down.weight", g("mlp.down_proj.weight")
