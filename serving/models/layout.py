"""The params pytree layout: the shape of every leaf for a `ModelConfig`.

The contract between loaders (checkpoints/), placement (sharding/) and the
model code (llama.py); docs/structure.md has the table. Layer weights are
stacked on a leading L axis; linear weights are `[in, out]` (`x @ w`).
"""

from __future__ import annotations

from typing import Any

from serving.models.model_config import ModelConfig

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> Params:
  """Shape of every params leaf for `cfg` (the tree of docs/structure.md)."""
  L, D, V, H = cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.head_dim
  NH, KH = cfg.num_heads * H, cfg.num_kv_heads * H
  layers = {
      "attn_norm": (L, D), "mlp_norm": (L, D),
      "wq": (L, D, NH), "wk": (L, D, KH), "wv": (L, D, KH), "wo": (L, NH, D),
  }
  if cfg.qkv_bias:
    layers.update(bq=(L, NH), bk=(L, KH), bv=(L, KH))
  if cfg.qk_norm:
    layers.update(q_norm=(L, H), k_norm=(L, H))
  if cfg.is_moe:
    E, M = cfg.num_experts, cfg.moe_intermediate_size
    layers.update(router=(L, D, E), we_gate=(L, E, D, M), we_up=(L, E, D, M),
                  we_down=(L, E, M, D))
  else:
    F = cfg.intermediate_size
    layers.update(w_gate=(L, D, F), w_up=(L, D, F), w_down=(L, F, D))
  shapes: Params = {"embed": (V, D), "final_norm": (D,), "layers": layers}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes
