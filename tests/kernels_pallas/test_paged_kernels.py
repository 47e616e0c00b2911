"""Pallas paged-attention kernels against the pure-jnp references.

Every kernel runs over a covering sample of the grid (page sizes 16/32/64,
GQA ratios 1/3/4/8, head dims 64/128, f32 and bf16, lengths 1 and exact page
multiples, padding rows, sliding window (static, or traced as in a scanned
layer stack, where 0 means none), soft cap, GPT-OSS attention sinks, several
pages per block) on
a poisoned page pool (NaN in every unused page, page tail and padding query,
and in the pages behind a window, which the engine releases; garbage
block-table entries), so an out-of-bounds read shows up as NaN.

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
  sinks: bool = False  # per-head sink logits
  traced: bool = False  # the window as a traced int32 scalar (0: no window)

  def __str__(self):
    dt = jnp.dtype(self.dtype).name
    return (f"ps{self.page_size}-k{self.kv_heads}g{self.group}-h{self.head_dim}-{dt}"
            f"-w{self.window}{'t' * self.traced}-c{self.cap}-ppb{self.pages_per_block}"
            f"-sp{self.num_splits}{'-sinks' * self.sinks}")


DECODE_CASES = [
  DecodeCase(16, 2, 1, 64, F32, (1, 16, 37, 0), pages_per_block=2),
  DecodeCase(32, 1, 3, 128, BF16, (64, 1, 50), pages_per_block=1, num_splits=1),
  DecodeCase(64, 1, 4, 64, BF16, (128, 65, 1), cap=2.0, pages_per_block=2),
  DecodeCase(16, 1, 8, 128, F32, (48, 0, 17), window=20, pages_per_block=2, num_splits=2),
  DecodeCase(32, 2, 4, 128, F32, (96, 31), window=40, cap=5.0, pages_per_block=2, num_splits=1),
  DecodeCase(64, 2, 8, 64, BF16, (64, 3), pages_per_block=1),
  DecodeCase(16, 3, 1, 64, BF16, (33, 16)),
  DecodeCase(32, 1, 8, 64, F32, (70, 5, 32)),
  # GPT-OSS-like: sinks, with a traced window and a cap, split-K; the tuned table
  DecodeCase(16, 2, 4, 64, F32, (48, 0, 17, 5), window=20, cap=2.0, pages_per_block=2,
             num_splits=2, sinks=True, traced=True),
  DecodeCase(32, 1, 8, 128, BF16, (70, 5, 32), sinks=True),
  DecodeCase(16, 1, 3, 64, F32, (40, 9), window=0, pages_per_block=2, traced=True),
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
  sinks: bool = False  # per-head sink logits
  traced: bool = False  # the window as a traced int32 scalar (0: no window)

  def __str__(self):
    dt = jnp.dtype(self.dtype).name
    return (f"ps{self.page_size}-k{self.kv_heads}g{self.group}-h{self.head_dim}-{dt}"
            f"-q{'_'.join(map(str, self.q_lens))}-w{self.window}{'t' * self.traced}"
            f"-c{self.cap}-ppb{self.pages_per_block}-qb{self.q_block}{'-sinks' * self.sinks}")


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
  # sinks with a traced window and a cap (a sequence with no new queries), sinks alone,
  # a traced 0 (no window)
  RaggedCase(16, 2, 4, 64, F32, (17, 3, 0, 1), (40, 3, 5, 20), 24, window=20, cap=2.0,
             pages_per_block=2, sinks=True, traced=True),
  RaggedCase(32, 1, 3, 128, BF16, (12, 1), (40, 64), 16, pages_per_block=1, sinks=True),
  RaggedCase(16, 1, 2, 64, F32, (9, 1), (30, 20), 16, window=0, pages_per_block=2,
             traced=True),
]


def case_options(case, seed: int) -> tuple[dict, dict]:
  """(kernel options, reference options) of a case: scale, cap, the window (a traced
  int32 for the kernel when ``case.traced``; the reference gets the static equivalent,
  0 meaning none) and random sinks (normal, std 2: as large as the logits)."""
  sinks = None
  if case.sinks:
    rng = np.random.default_rng(seed)
    sinks = jnp.asarray(rng.normal(0.0, 2.0, case.kv_heads * case.group), jnp.float32)
  ref = dict(scale=case.head_dim**-0.5, sliding_window=case.window or None, soft_cap=case.cap,
             sinks=sinks)
  window = jnp.int32(case.window or 0) if case.traced else case.window
  return dict(ref, sliding_window=window), ref


def run_kernel(fn, args, opts, interpret, **static):
  """``fn(*args, **opts, **static)`` jitted; a traced window is a jit argument."""
  window = opts.pop("sliding_window")
  call = functools.partial(fn, **opts, **static, interpret=interpret)
  if isinstance(window, jax.Array):
    kernel = jax.jit(lambda w, *a: call(*a, sliding_window=w),
                     compiler_options=_FAST_COMPILE if interpret else None)
    return kernel(window, *args)
  kernel = jax.jit(functools.partial(call, sliding_window=window),
                   compiler_options=_FAST_COMPILE if interpret else None)
  return kernel(*args)


def _check(out, ref, dtype):
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "NaN/inf in kernel output: a poisoned value was read"
  np.testing.assert_allclose(out, np.asarray(ref, np.float32), **testing.tolerance(dtype))


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_decode_kernel_matches_reference(impl, case):
  interpret = _mode(impl)
  seed = zlib.crc32(str(case).encode())
  inputs = testing.make_decode_inputs(
    seed, case.seq_lens, page_size=case.page_size,
    num_kv_heads=case.kv_heads, group=case.group, head_dim=case.head_dim, dtype=case.dtype,
    window=case.window or None)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.lens)
  opts, ref_opts = case_options(case, seed)
  sizes = None
  if case.pages_per_block:
    sizes = BlockSizes(pages_per_block=case.pages_per_block, num_splits=case.num_splits)
  out = run_kernel(paged_decode_attention, args, opts, interpret, impl=impl, block_sizes=sizes)
  assert out.shape == inputs.q.shape and out.dtype == inputs.q.dtype
  _check(out, paged_decode_attention(*args, **ref_opts), case.dtype)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_ragged_kernel_matches_reference(impl, case):
  interpret = _mode(impl)
  seed = zlib.crc32(str(case).encode())
  inputs = testing.make_ragged_inputs(
    seed, case.q_lens, case.kv_lens, num_tokens=case.num_tokens,
    page_size=case.page_size, num_kv_heads=case.kv_heads, group=case.group,
    head_dim=case.head_dim, dtype=case.dtype, window=case.window or None)
  args = (inputs.q, inputs.k_pages, inputs.v_pages, inputs.block_tables, inputs.cu_q_lens,
          inputs.lens)
  opts, ref_opts = case_options(case, seed)
  sizes = None
  if case.pages_per_block:
    sizes = BlockSizes(pages_per_block=case.pages_per_block, q_block=case.q_block)
  out = run_kernel(ragged_paged_attention, args, opts, interpret, impl=impl, block_sizes=sizes)
  assert out.shape == inputs.q.shape and out.dtype == inputs.q.dtype
  _check(out, ragged_paged_attention(*args, **ref_opts), case.dtype)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_per_layer_window_in_a_scan(impl):
  """A layer stack as lax.scan over a per-layer window array (0: full attention), with
  sinks: each layer's kernel output equals the reference with that layer's window."""
  interpret = _mode(impl)
  x = testing.make_decode_inputs(5, (40, 9, 0), page_size=16, num_kv_heads=1, group=4,
                                 head_dim=64, dtype=F32)
  args = (x.q, x.k_pages, x.v_pages, x.block_tables, x.lens)
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
  sizes = BlockSizes(pages_per_block=1, num_splits=2)

  def layer(carry, w):
    return carry, paged_decode_attention(*args, scale=0.125, sliding_window=w, sinks=sinks,
                                         impl=impl, interpret=interpret, block_sizes=sizes)

  stack = jax.jit(lambda ws: jax.lax.scan(layer, None, ws)[1],
                  compiler_options=_FAST_COMPILE if interpret else None)
  out = stack(jnp.asarray([5, 0, 20], jnp.int32))
  for i, w in enumerate([5, None, 20]):
    _check(out[i], paged_decode_attention(*args, scale=0.125, sliding_window=w, sinks=sinks),
           F32)


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
