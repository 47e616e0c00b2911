"""Random GGUF K-quant blocks (gguf-py has no K-quant quantizer) for kernel and engine tests.

`random_blocks(rng, qtype, rows, cols)` returns the raw bytes of a `[rows, cols]`
tensor of Q4_K / Q5_K / Q6_K (or Q8_0 / Q4_0, quantized from random floats by
gguf-py): random codes and scale bytes, with finite float16 super-block scales
of a size that keeps the values near `scale`. `random_weight` maps such blocks
through `checkpoints.quantize.gguf_quantized_weight`, as the loader does.
"""

from __future__ import annotations

import gguf
import numpy as np

from checkpoints import gguf as gguf_io
from checkpoints import quantize

Q = gguf.GGMLQuantizationType
# Byte offsets of each block's float16 super-block values: (d, dmin) or (d,).
_SUPER_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(rng: np.random.Generator, qtype, rows: int, cols: int,
                  scale: float = 0.05) -> np.ndarray:
  """uint8 `[rows, cols / block * type_size]`: a tensor's GGUF blocks of `qtype`."""
  if qtype not in _SUPER_AT:
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    return gguf.quants.quantize(x, qtype)
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  # Codes reach 15 (Q4_K), 31 (Q5_K) or +-32 (Q6_K) times a scale code of up to 63 (or
  # +-127): d keeps the largest value near `scale`.
  top = {Q.Q4_K: 15 * 63, Q.Q5_K: 31 * 63, Q.Q6_K: 32 * 127}[qtype]
  for at in _SUPER_AT[qtype]:
    raw[..., at:at + 2] = (rng.uniform(0.2, 1.0, raw.shape[:2] + (1,)) * scale / top).astype(
        np.float16).view(np.uint8)
  return raw.reshape(rows, -1)


def random_weight(rng: np.random.Generator, qtype, rows: int, cols: int, scale: float = 0.05):
  """A QuantizedWeight `[cols, rows]` (stored `[rows, cols]`) holding random `qtype` blocks."""
  raw = gguf_io.RawTensor(name="w", ggml_type=qtype, shape=(rows, cols),
                          data=random_blocks(rng, qtype, rows, cols, scale))
  return quantize.gguf_quantized_weight(raw)
