"""Pallas paged-attention kernels against the pure-jnp references.

Every kernel runs over a covering sample of the grid (page sizes 16/32/64,
GQA ratios 1/3/4/8, head dims 64/128, f32 and bf16, lengths 1 and exact page
multiples, padding rows, sliding window, soft cap, several pages per block) on
a poisoned page pool (NaN in every unused page, page tail and padding query;
garbage block-table entries), so an out-of-bounds read shows up as NaN.

On CPU each kernel runs in Pallas interpret mode. A kernel runs compiled when
the default backend is its own platform (``benchmarks/device_check.sh`` on a
CUDA machine); on other accelerators it is skipped.
"""

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import BlockSizes, paged_decode_attention, ragged_paged_attention
from kernels_pallas.paged_attention import testing

F32, BF16 = jnp.float32, jnp.bfloat16
# Interpret-mode programs are big and run once: skip XLA's backend optimisations.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _mode(impl):
  """interpret flag for ``impl`` on this backend, or a pytest skip."""
  backend = jax.default_backend()
  if backend == "cpu":
    return True
  if backend == impl:
    return False
  pytest.skip(f"{impl} kernel: compiled only on {impl}; interpreted only on CPU")


class DecodeCase(NamedTuple):
  page_size: int
  kv_heads: int
  group: int
  head_dim: int
  dtype: object
  seq_lens: tuple
  window: int | None = None
  cap: float | None = None
  pages_per_block: int | None = None  # None: the tuned table
  num_splits: int = 0  # GPU decode; 0: automatic (several for these small batches)

  def __str__(self):
    dt = jnp.dtype(self.dtype).name
    return (f"ps{self.page_size}-k{self.kv_heads}g{self.group}-h{self.head_dim}-{dt}"
            f"-w{self.window}-c{self.cap}-ppb{self.pages_per_block}-sp{self.num_splits}")


DECODE_CASES = [
  DecodeCase(16, 2, 1, 64, F32, (1, 16, 37, 0), pages_per_block=2),
  DecodeCase(32, 1, 3, 128, BF16, (64, 1, 50), pages_per_block=1, num_splits=1),
  DecodeCase(64, 1, 4, 64, BF16, (128, 65, 1), cap=2.0, pages_per_block=2),
  DecodeCase(16, 1, 8, 128, F32, (48, 0, 17), window=20, pages_per_block=2, num_splits=2),
  DecodeCase(32, 2, 4, 128, F32, (96, 31), window=40, cap=5.0, pages_per_block=2, num_splits=1),
  DecodeCase(64, 2, 8, 64, BF16, (64, 3), pages_per_block=1),
  DecodeCase(16, 3, 1, 64, BF16, (33, 16)),
  DecodeCase(32, 1, 8, 64, F32, (70, 5, 32)),
]


class RaggedCase(NamedTuple):
  page_size: int
  kv_heads: int
  group: int
  head_dim: int
  dtype: object
  q_lens: tuple
  kv_lens: tuple
  num_tokens: int
  window: int | None = None
  cap: float | None = None
  pages_per_block: int | None = None  # None: the tuned table
  q_block: int = 8

  def __str__(self):
    dt = jnp.dtype(self.dtype).name
    return (f"ps{self.page_size}-k{self.kv_heads}g{self.group}-h{self.head_dim}-{dt}"
            f"-q{'_'.join(map(str, self.q_lens))}-w{self.window}-c{self.cap}"
            f"-ppb{self.pages_per_block}-qb{self.q_block}")


RAGGED_CASES = [
  # chunked prefill + decode + whole prefill of exactly one page
  RaggedCase(16, 2, 1, 64, F32, (5, 1, 16), (37, 16, 16), 32, pages_per_block=2),
  # decode at an exact page multiple, a sequence with no new queries
  RaggedCase(32, 1, 3, 128, BF16, (1, 0, 9), (64, 5, 9), 16, pages_per_block=1),
  RaggedCase(64, 1, 4, 64, BF16, (30, 2), (128, 66), 40, cap=2.0, pages_per_block=2, q_block=16),
  RaggedCase(16, 1, 8, 128, F32, (17, 3), (40, 3), 24, window=8, pages_per_block=2),
  RaggedCase(32, 2, 4, 128, F32, (12, 7), (40, 33), 24, window=20, cap=3.0, pages_per_block=2,
             q_block=16),
  RaggedCase(64, 1, 3, 64, F32, (1, 1, 1), (1, 64, 100), 8),
]


def _check(out, ref, dtype):
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "NaN/inf in kernel output: a poisoned value was read"
  np.testing.assert_allclose(out, np.asarray(ref, np.float32), **testing.tolerance(dtype))


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_decode_kernel_matches_reference(impl, case):
  interpret = _mode(impl)
  inputs = testing.make_decode_inputs(
    zlib.crc32(str(case).encode()), case.seq_lens, page_size=case.page_size,
    num_kv_heads=case.kv_heads, group=case.group, head_dim=case.head_dim, dtype=case.dtype)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.lens)
  opts = dict(scale=case.head_dim**-0.5, sliding_window=case.window, soft_cap=case.cap)
  sizes = None
  if case.pages_per_block:
    sizes = BlockSizes(pages_per_block=case.pages_per_block, num_splits=case.num_splits)
  kernel = jax.jit(functools.partial(paged_decode_attention, **opts, impl=impl,
                                     interpret=interpret, block_sizes=sizes),
                   compiler_options=_FAST_COMPILE if interpret else None)
  out = kernel(*args)
  assert out.shape == inputs.q.shape and out.dtype == inputs.q.dtype
  _check(out, paged_decode_attention(*args, **opts), case.dtype)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_ragged_kernel_matches_reference(impl, case):
  interpret = _mode(impl)
  inputs = testing.make_ragged_inputs(
    zlib.crc32(str(case).encode()), case.q_lens, case.kv_lens, num_tokens=case.num_tokens,
    page_size=case.page_size, num_kv_heads=case.kv_heads, group=case.group,
    head_dim=case.head_dim, dtype=case.dtype)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.cu_q_lens,
          inputs.lens)
  opts = dict(scale=case.head_dim**-0.5, sliding_window=case.window, soft_cap=case.cap)
  sizes = None
  if case.pages_per_block:
    sizes = BlockSizes(pages_per_block=case.pages_per_block, q_block=case.q_block)
  kernel = jax.jit(functools.partial(ragged_paged_attention, **opts, impl=impl,
                                     interpret=interpret, block_sizes=sizes),
                   compiler_options=_FAST_COMPILE if interpret else None)
  out = kernel(*args)
  assert out.shape == inputs.q.shape and out.dtype == inputs.q.dtype
  _check(out, ragged_paged_attention(*args, **opts), case.dtype)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_f32_queries_on_bf16_pages(impl):
  """The engine may keep activations in f32 and the KV cache in bf16."""
  interpret = _mode(impl)
  inputs = testing.make_ragged_inputs(7, (9, 1), (9, 20), num_tokens=16, page_size=16,
                                      num_kv_heads=1, group=2, head_dim=64, dtype=F32,
                                      kv_dtype=BF16)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.cu_q_lens,
          inputs.lens)
  sizes = BlockSizes(pages_per_block=1, q_block=8)
  rag = jax.jit(functools.partial(ragged_paged_attention, scale=0.125, impl=impl,
                                  interpret=interpret, block_sizes=sizes),
                compiler_options=_FAST_COMPILE if interpret else None)
  out = rag(*args)
  assert out.dtype == F32
  _check(out, ragged_paged_attention(*args, scale=0.125), BF16)
  # Decode rows: the last query of each sequence.
  dec = jax.jit(functools.partial(paged_decode_attention, scale=0.125, impl=impl,
                                  interpret=interpret, block_sizes=sizes),
                compiler_options=_FAST_COMPILE if interpret else None)
  rows = inputs.cu_q_lens[1:] - 1
  out = dec(inputs.q[rows], inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.lens)
  assert out.dtype == F32
  _check(out, paged_decode_attention(inputs.q[rows], inputs.k_pages, inputs.v_pages,
                                     inputs.block_tables, inputs.lens, scale=0.125), BF16)


def test_tpu_whole_page_blocks():
  """kv_heads_per_block = K: each page slot is one contiguous [page_size, K * H] copy."""
  interpret = _mode("tpu")
  inputs = testing.make_ragged_inputs(3, (6, 1), (21, 40), num_tokens=8, page_size=16,
                                      num_kv_heads=2, group=2, head_dim=128, dtype=BF16)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.cu_q_lens,
          inputs.lens)
  sizes = BlockSizes(pages_per_block=2, q_block=8, kv_heads_per_block=2)
  kernel = jax.jit(functools.partial(ragged_paged_attention, scale=0.1, impl="tpu",
                                     interpret=interpret, block_sizes=sizes),
                   compiler_options=_FAST_COMPILE if interpret else None)
  _check(kernel(*args), ragged_paged_attention(*args, scale=0.1), BF16)
  with pytest.raises(ValueError, match="kv_heads_per_block"):
    ragged_paged_attention(*args, scale=0.1, impl="tpu", interpret=True,
                           block_sizes=BlockSizes(pages_per_block=2, q_block=8,
                                                  kv_heads_per_block=3))
