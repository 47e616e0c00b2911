"""The params pytree layout: the shape of every leaf for a `ModelConfig`.

The contract between loaders (checkpoints/), placement (sharding/) and the
model code. The family's nnx module declares the leaves
(serving/models/causal_lm.py); docs/structure.md has the table. Layer
weights are stacked on a leading L axis; linear weights are `[in, out]`
(`x @ w`).
"""

from __future__ import annotations

from typing import Any

from serving.models import causal_lm
from serving.models.model_config import ModelConfig

Params = dict[str, Any]


def param_shapes(cfg: ModelConfig) -> Params:
  """Shape of every params leaf for `cfg` (the tree of docs/structure.md)."""
  return causal_lm.param_shapes(cfg)
