"""Cross-platform lowering of the kernels: Mosaic TPU and Triton, without the device.

``jit(...).trace(...).lower(lowering_platforms=(...,))`` runs the Pallas
Mosaic-TPU and Triton lowerings on a CPU-only machine. That catches what
interpret mode cannot: primitives without a TPU/Triton lowering rule, TPU
block-shape rules (last two block dims), Triton's power-of-two tensor sizes.
The device compilers (Mosaic layout passes in libtpu, Triton to PTX) still
need the device: ``benchmarks/device_check.sh``.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import BlockSizes
from kernels_pallas.paged_attention import (
  decode_gpu,
  decode_tpu,
  ragged_gpu,
  ragged_tpu,
  testing,
)

KERNELS = {
  ("tpu", "decode"): decode_tpu.paged_decode_attention,
  ("tpu", "ragged"): ragged_tpu.ragged_paged_attention,
  ("cuda", "decode"): decode_gpu.paged_decode_attention,
  ("cuda", "ragged"): ragged_gpu.ragged_paged_attention,
}
# (kv heads, group, head dim, dtype, window, cap, TPU kv heads per block, sinks, traced
# window: an int32 [1] operand, scalar-prefetched on TPU)
CONFIGS = [
  (2, 4, 128, jnp.bfloat16, None, None, 0, False, False),
  (2, 3, 64, jnp.float32, 8, 2.0, 0, False, False),
  (8, 1, 128, jnp.bfloat16, None, 30.0, 0, False, False),
  (1, 8, 64, jnp.bfloat16, 16, None, 0, False, False),
  (4, 2, 128, jnp.bfloat16, None, None, 4, False, False),
  (2, 4, 64, jnp.bfloat16, 16, None, 0, True, True),  # GPT-OSS-like: sinks, per-layer window
  (2, 3, 128, jnp.float32, None, 2.0, 2, True, False),
]


def _lower(platform, op, config, kv_quant=None):
  kv_heads, group, head_dim, dtype, window, cap, heads_per_block, sinks, traced = config
  common = dict(page_size=16, num_kv_heads=kv_heads, group=group, head_dim=head_dim,
                dtype=dtype, poison=False, kv_quant=kv_quant)
  if op == "decode":
    x = testing.make_decode_inputs(0, [33, 16, 0], **common)
    args = (x.q, x.k_pages, x.v_pages, x.block_tables, x.lens)
  else:
    x = testing.make_ragged_inputs(0, [5, 1, 16], [37, 16, 16], num_tokens=32, **common)
    args = (x.q, x.k_pages, x.v_pages, x.block_tables, x.cu_q_lens, x.lens)
  sizes = BlockSizes(pages_per_block=2, q_block=16, kv_heads_per_block=heads_per_block)
  extra = dict(sinks=jnp.linspace(-1.0, 1.0, kv_heads * group) if sinks else None,
               window=jnp.full((1,), window, jnp.int32) if traced else None)
  fn = functools.partial(KERNELS[platform, op], scale=head_dim**-0.5,
                         sliding_window=None if traced else window, soft_cap=cap,
                         block_sizes=sizes, kv_quant=kv_quant)
  return jax.jit(fn).trace(*args, **extra).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("op", ["decode", "ragged"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_kernel_lowers(platform, op, config):
  text = _lower(platform, op, config)
  target = "tpu_custom_call" if platform == "tpu" else "triton"
  assert target in text


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3], CONFIGS[5]], ids=str)
@pytest.mark.parametrize("kv_quant", ["int8", "fp8"])
@pytest.mark.parametrize("op", ["decode", "ragged"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_quantized_kernel_lowers(platform, op, kv_quant, config):
  """uint8 [..., H + 4] pages: byte loads, the uint32 scale bitcast, code conversions."""
  text = _lower(platform, op, config, kv_quant)
  target = "tpu_custom_call" if platform == "tpu" else "triton"
  assert target in text
