"""The MXFP4 `QuantizedWeight` kind against transformers' dequantization.

Blocks are written here in the checkpoint layout (tests/mxfp4_testutil.py);
`convert_moe_packed_tensors` (transformers' integrations/mxfp4.py) is the
reference, and a hand-worked block pins the values and the nibble order.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from mxfp4_testutil import dequantize_reference, pack_mxfp4

from serving.models.quantized import FP4_VALUES, QuantizedWeight


def mxfp4_weight(blocks: np.ndarray, scales: np.ndarray) -> QuantizedWeight:
  """Checkpoint blocks [..., Out, G, 16] + scales [..., Out, G] -> the weight (no copy of
  values: the bytes are the codes)."""
  return QuantizedWeight(q=blocks.reshape(*blocks.shape[:-2], -1), scale=scales, kind="mxfp4",
                         group_size=32)


def test_known_block_exact():
  # Inputs 0..15 take codes 0..15, inputs 16..31 codes 15..0; byte j = code 2j | code 2j+1 << 4.
  codes = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.uint8)
  blocks = (codes[0::2] | (codes[1::2] << 4)).reshape(1, 1, 1, 16)
  assert blocks[0, 0, 0, :2].tolist() == [0x10, 0x32]
  scales = np.full((1, 1, 1), 128, np.uint8)  # 2^(128 - 127) = 2
  want = 2.0 * np.asarray(FP4_VALUES, np.float32)[codes]
  assert want[:8].tolist() == [0, 1, 2, 3, 4, 6, 8, 12] and want[9] == -1
  got = np.asarray(mxfp4_weight(blocks, scales).dequantize())[0, 0]
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(dequantize_reference(blocks, scales)[0, :, 0], want)


def test_random_blocks_match_transformers():
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)  # [E, Out, In/32, 16]
  scales = rng.integers(100, 150, (3, 8, 4), dtype=np.uint8)
  w = mxfp4_weight(blocks, scales)
  assert w.shape == (3, 128, 8) and w.in_features == 128
  want = dequantize_reference(blocks, scales)  # [E, In, Out]
  np.testing.assert_array_equal(np.asarray(w.dense(jnp.zeros((2, 128)))), want)
  x = rng.standard_normal((5, 128)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(w[1].matmul(jnp.asarray(x))), x @ want[1], rtol=1e-5,
                             atol=1e-5)


def test_extreme_exponents():
  blocks = np.full((1, 2, 1, 16), 0x21, np.uint8)  # codes 1, 2: 0.5, 1.0
  scales = np.asarray([2, 254], np.uint8).reshape(1, 2, 1)  # 2^-125 and 2^127
  got = np.asarray(mxfp4_weight(blocks, scales).dequantize())[0]
  assert got[0, :2].tolist() == [2.0 ** -126, 2.0 ** -125]
  assert got[1, :2].tolist() == [2.0 ** 126, 2.0 ** 127]


def test_packer_round_trips_representable_values():
  rng = np.random.default_rng(1)
  values = rng.choice(np.asarray(FP4_VALUES[1:8] + FP4_VALUES[9:], np.float32), (4, 64))
  values[:, ::32] = 6.0  # every group reaches 6: exponent 0 (scale byte 127)
  blocks, scales = pack_mxfp4(values * 0.25)  # exponent -2
  assert (scales == 125).all()
  np.testing.assert_array_equal(np.asarray(mxfp4_weight(blocks, scales).dequantize()),
                                values * 0.25)


def test_rejects_other_groups():
  with pytest.raises(ValueError, match="mxfp4"):
    QuantizedWeight(q=np.zeros((4, 16), np.uint8), scale=np.zeros((4, 2), np.uint8),
                    kind="mxfp4", group_size=16)
