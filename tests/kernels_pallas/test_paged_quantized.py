"""Quantized (int8 / fp8) KV pages: the kernels dequantize per block, inside the kernel.

Pages are uint8 ``[P, page_size, K, H + 4]``: H one-byte codes, then the row's
float32 scale as 4 little-endian bytes (the engine's KV-cache layout). Every
kernel gets the quantized pool with ``kv_quant`` and must match the reference
run on the same pages dequantized here with numpy (an implementation
independent of ``common.dequantize``). Pools are poisoned as in
test_paged_kernels.py: unused pages and page tails get a NaN scale, padding
query rows are NaN, block-table entries past a sequence are garbage.

On CPU each kernel runs in Pallas interpret mode (see test_paged_kernels.py).
"""

import zlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_paged_kernels import (
  BF16,
  F32,
  DecodeCase,
  RaggedCase,
  _check,
  _mode,
  case_options,
  run_kernel,
)

from kernels_pallas import BlockSizes, paged_decode_attention, ragged_paged_attention
from kernels_pallas.paged_attention import reference, testing

QUANTS = ["int8", "fp8"]
_CODES = {"int8": np.int8, "fp8": ml_dtypes.float8_e4m3fn}


def dequantize_np(pages, kv_quant):
  """uint8 [..., H + 4] -> float32 [..., H], in numpy."""
  pages = np.ascontiguousarray(np.asarray(pages))
  codes = pages[..., :-4].view(_CODES[kv_quant]).astype(np.float32)
  scale = np.ascontiguousarray(pages[..., -4:]).view("<f4")  # [..., 1]
  return jnp.asarray(codes * scale)


DECODE_CASES = [
  DecodeCase(16, 2, 1, 64, F32, (1, 16, 37, 0), pages_per_block=2),
  DecodeCase(32, 1, 4, 128, BF16, (64, 1, 50), window=40, cap=5.0, pages_per_block=1,
             num_splits=2),
  DecodeCase(16, 2, 2, 64, F32, (37, 0, 16), window=9, pages_per_block=2, num_splits=2,
             sinks=True, traced=True),
]
RAGGED_CASES = [
  # chunked prefill + decode + whole prefill of exactly one page
  RaggedCase(16, 2, 1, 64, F32, (5, 1, 16), (37, 16, 16), 32, pages_per_block=2),
  # a sequence with no new queries, decode at an exact page multiple, window, cap
  RaggedCase(32, 1, 4, 128, BF16, (12, 0, 1), (40, 5, 64), 24, window=20, cap=3.0,
             pages_per_block=2, q_block=16),
  RaggedCase(16, 2, 2, 64, F32, (5, 1), (37, 16), 16, window=9, pages_per_block=2,
             sinks=True, traced=True),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("kv_quant", QUANTS)
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_decode_kernel_quantized_pages(impl, kv_quant, case):
  interpret = _mode(impl)
  x = testing.make_decode_inputs(
    zlib.crc32(f"{case}{kv_quant}".encode()), case.seq_lens, page_size=case.page_size,
    num_kv_heads=case.kv_heads, group=case.group, head_dim=case.head_dim, dtype=case.dtype,
    kv_quant=kv_quant, window=case.window or None)
  assert x.k_pages.dtype == jnp.uint8 and x.k_pages.shape[-1] == case.head_dim + 4
  opts, ref_opts = case_options(case, zlib.crc32(str(case).encode()))
  sizes = BlockSizes(pages_per_block=case.pages_per_block, num_splits=case.num_splits)
  args = (x.q, x.k_pages, x.v_pages, x.block_tables, x.lens)
  out = run_kernel(paged_decode_attention, args, opts, interpret, impl=impl, block_sizes=sizes,
                   kv_quant=kv_quant)
  assert out.shape == x.q.shape and out.dtype == x.q.dtype
  ref = paged_decode_attention(x.q, dequantize_np(x.k_pages, kv_quant),
                               dequantize_np(x.v_pages, kv_quant), x.block_tables, x.lens,
                               **ref_opts)
  _check(out, ref, case.dtype)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
@pytest.mark.parametrize("kv_quant", QUANTS)
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_ragged_kernel_quantized_pages(impl, kv_quant, case):
  interpret = _mode(impl)
  x = testing.make_ragged_inputs(
    zlib.crc32(f"{case}{kv_quant}".encode()), case.q_lens, case.kv_lens,
    num_tokens=case.num_tokens, page_size=case.page_size, num_kv_heads=case.kv_heads,
    group=case.group, head_dim=case.head_dim, dtype=case.dtype, kv_quant=kv_quant,
    window=case.window or None)
  opts, ref_opts = case_options(case, zlib.crc32(str(case).encode()))
  sizes = BlockSizes(pages_per_block=case.pages_per_block, q_block=case.q_block)
  args = (x.q, x.k_pages, x.v_pages, x.block_tables, x.cu_q_lens, x.lens)
  out = run_kernel(ragged_paged_attention, args, opts, interpret, impl=impl, block_sizes=sizes,
                   kv_quant=kv_quant)
  assert out.shape == x.q.shape and out.dtype == x.q.dtype
  ref = ragged_paged_attention(x.q, dequantize_np(x.k_pages, kv_quant),
                               dequantize_np(x.v_pages, kv_quant), x.block_tables, x.cu_q_lens,
                               x.lens, **ref_opts)
  _check(out, ref, case.dtype)


@pytest.mark.parametrize("kv_quant", QUANTS)
def test_reference_dequantizes_like_numpy(kv_quant):
  """The oracle itself: ref on quantized pages == ref on the numpy-dequantized pages."""
  x = testing.make_ragged_inputs(5, (3, 1), (9, 20), num_tokens=8, page_size=4, num_kv_heads=2,
                                 group=2, head_dim=8, dtype=F32, kv_quant=kv_quant)
  deq = [dequantize_np(p, kv_quant) for p in (x.k_pages, x.v_pages)]
  out = ragged_paged_attention(x.q, x.k_pages, x.v_pages, x.block_tables, x.cu_q_lens, x.lens,
                               scale=0.3, kv_quant=kv_quant)
  ref = ragged_paged_attention(x.q, *deq, x.block_tables, x.cu_q_lens, x.lens, scale=0.3)
  _check(out[:4], ref[:4], F32)
  rows = x.cu_q_lens[1:] - 1
  out = paged_decode_attention(x.q[rows], x.k_pages, x.v_pages, x.block_tables, x.lens,
                               scale=0.3, kv_quant=kv_quant)
  _check(out, ref[rows], F32)
  # Quantized pages approximate the float keys: compare against the unquantized pool.
  f = testing.make_ragged_inputs(5, (3, 1), (9, 20), num_tokens=8, page_size=4, num_kv_heads=2,
                                 group=2, head_dim=8, dtype=F32)
  exact = ragged_paged_attention(f.q, f.k_pages, f.v_pages, f.block_tables, f.cu_q_lens, f.lens,
                                 scale=0.3)
  np.testing.assert_allclose(np.asarray(ref[:4]), np.asarray(exact[:4]), atol=0.1)


def test_dequantize_hand_worked():
  """Byte order: codes, then the float32 scale little endian (0.5 = 00 00 00 3f)."""
  half = [0x00, 0x00, 0x00, 0x3F]
  int8_row = np.array([[1, 0xFE, 0x7F, *half]], np.uint8)  # codes 1, -2, 127
  np.testing.assert_array_equal(reference.dequantize_pages(jnp.asarray(int8_row), "int8"),
                                [[0.5, -1.0, 63.5]])
  fp8_row = np.array([[0x38, 0xC0, 0x01, *half]], np.uint8)  # 1.0, -2.0, 2**-9
  np.testing.assert_array_equal(reference.dequantize_pages(jnp.asarray(fp8_row), "fp8"),
                                [[0.5, -1.0, 2.0**-10]])
  for kv_quant in QUANTS:
    pages = testing.quantize_pages(np.array([[3.0, -1.5, 0.0, 0.75]], np.float32), kv_quant)
    assert pages.dtype == jnp.uint8 and pages.shape == (1, 8)
    np.testing.assert_allclose(reference.dequantize_pages(pages, kv_quant),
                               [[3.0, -1.5, 0.0, 0.75]], rtol=0.02)


def _pages(**overrides):
  """Decode and ragged arguments on int8 pages [5, 4, 2, 8 + 4], with ``overrides``."""
  x = testing.make_decode_inputs(0, [3, 4], page_size=4, num_kv_heads=2, group=2, head_dim=8,
                                 dtype=F32, kv_quant="int8")
  y = testing.make_ragged_inputs(0, [2, 1], [3, 4], num_tokens=4, page_size=4, num_kv_heads=2,
                                 group=2, head_dim=8, dtype=F32, kv_quant="int8")
  assert x.k_pages.shape == y.k_pages.shape == (5, 4, 2, 12)
  decode = dict(q=x.q, k_pages=x.k_pages, v_pages=x.v_pages, block_tables=x.block_tables,
                seq_lens=x.lens)
  ragged = dict(q=y.q, k_pages=y.k_pages, v_pages=y.v_pages, block_tables=y.block_tables,
                cu_q_lens=y.cu_q_lens, kv_lens=y.lens)
  return {**decode, **overrides}, {**ragged, **overrides}


@pytest.mark.parametrize(
  "kv_quant, overrides, error, match",
  [
    ("int4", {}, ValueError, "kv_quant must be one of"),
    (None, {}, TypeError, "kv_quant='int8' or 'fp8'"),  # uint8 pages, no kv_quant
    ("int8", dict(k_pages=jnp.zeros((5, 4, 2, 12), F32), v_pages=jnp.zeros((5, 4, 2, 12), F32)),
     TypeError, "needs uint8 k_pages"),
    ("fp8", dict(k_pages=jnp.zeros((5, 4, 2, 8), jnp.uint8),
                 v_pages=jnp.zeros((5, 4, 2, 8), jnp.uint8)),
     ValueError, "needs k_pages last dim 12, got 8"),  # no room for the scale bytes
    ("int8", dict(v_pages=jnp.zeros((5, 4, 2, 12), jnp.int8)), TypeError, "v_pages dtype"),
    ("int8", dict(v_pages=jnp.zeros((5, 4, 2, 13), jnp.uint8)), ValueError, "v_pages shape"),
  ],
)
def test_quantized_validation(kv_quant, overrides, error, match):
  decode, ragged = _pages(**overrides)
  with pytest.raises(error, match=match):
    paged_decode_attention(**decode, scale=1.0, kv_quant=kv_quant)
  with pytest.raises(error, match=match):
    ragged_paged_attention(**ragged, scale=1.0, kv_quant=kv_quant)


def test_quantized_validation_q_head_dim():
  decode, _ = _pages(q=jnp.zeros((2, 4, 12)))  # q as wide as the stored row: forgot the scale
  with pytest.raises(ValueError, match="q head_dim 12 needs k_pages last dim 16, got 12"):
    paged_decode_attention(**decode, scale=1.0, kv_quant="int8")
