"""Tests for serving.runner.kv_cache: the page pool's creation, its host memory, and the
page export / import that moves pages between pools."""

import ctypes
import mmap
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.models.model_config import ModelConfig
from serving.runner.kv_cache import create_kv_cache, read_pages, release_zero_pages, write_pages

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
                  num_layers=8, num_heads=4, num_kv_heads=2, head_dim=64)
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, /proc")


def _resident_fraction(pool: jax.Array) -> float:
  """The share of the pool's whole memory pages that are resident (mincore)."""
  libc = ctypes.CDLL(None, use_errno=True)
  start = pool.unsafe_buffer_pointer()
  first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
  pages = (start + pool.nbytes - first) // mmap.PAGESIZE
  vec = (ctypes.c_ubyte * pages)()
  assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
  return sum(b & 1 for b in vec) / pages


@linux_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_new_pool_reads_zero_and_is_not_resident(dtype):
  kv = create_kv_cache(CFG, num_pages=1025, page_size=16, dtype=dtype)
  assert _resident_fraction(kv.k) < 0.01 and _resident_fraction(kv.v) < 0.01
  assert not jnp.any(kv.k) and not jnp.any(kv.v)


@linux_only
def test_written_pages_keep_their_values_and_the_rest_stay_zero():
  # 134 MB: XLA:CPU may back the buffer with 2 MiB huge pages, so a written page can
  # make up to 2 MiB resident.
  kv = create_kv_cache(CFG, num_pages=2049, page_size=16, dtype="float32")
  write = jax.jit(lambda pool, page, x: pool.at[page].set(x), donate_argnums=0)
  rng = np.random.default_rng(0)
  rows = {3: rng.standard_normal(kv.k.shape[1:], np.float32),
          9000: rng.standard_normal(kv.k.shape[1:], np.float32)}
  k = kv.k
  for page, x in rows.items():
    k = write(k, page, x)
  assert _resident_fraction(k) < 0.05  # two written pages: at most 2 x 2 MiB
  host = np.asarray(k)
  for page, x in rows.items():
    np.testing.assert_array_equal(host[page], x)
  untouched = np.ones(host.shape[0], bool)
  untouched[list(rows)] = False
  assert not host[untouched].any()


@linux_only
def test_release_of_a_written_pool_zeroes_whole_pages_only():
  """The contract: only for all-zero pools, since the released interior reads zero again
  and the partial pages at the edges keep their bytes."""
  pool = jnp.ones((256, 1024), jnp.float32)
  released = release_zero_pages(pool)
  assert 0 < released <= pool.nbytes
  assert released % 4096 == 0
  assert int(jnp.count_nonzero(pool == 0)) * 4 == released


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_write_pages_puts_each_slot_in_its_page_of_every_layer(dtype):
  """write_pages against a numpy reference: slot i lands in page pages[i] of every layer,
  a page named twice (the dummy page 0 taking padding) keeps its last slot, and no other
  page changes; read_pages gives the slots back."""
  kv = create_kv_cache(CFG, num_pages=7, page_size=4, dtype=dtype)
  rng = np.random.default_rng(0)
  fill = (lambda shape: rng.integers(-100, 100, shape).astype(kv.k.dtype)) if dtype == "int8" \
      else (lambda shape: rng.standard_normal(shape).astype(kv.k.dtype))
  kv = kv.__class__(k=jnp.asarray(fill(kv.k.shape)), v=jnp.asarray(fill(kv.v.shape)),
                    num_pages=kv.num_pages, dtype=kv.dtype, layout=kv.layout)
  before_k, before_v = np.asarray(kv.k), np.asarray(kv.v)
  layers = kv.k.shape[0] // kv.num_pages
  pages = np.array([5, 2, 0, 0], np.int32)
  new_k, new_v = (fill((layers, 4, *kv.k.shape[1:])) for _ in range(2))
  out = write_pages(kv, jnp.asarray(pages), jnp.asarray(new_k), jnp.asarray(new_v))
  for got, before, new in ((out.k, before_k, new_k), (out.v, before_v, new_v)):
    want = before.reshape(layers, kv.num_pages, *before.shape[1:]).copy()
    for slot, page in enumerate(pages):
      want[:, page] = new[:, slot]
    np.testing.assert_array_equal(np.asarray(got), want.reshape(before.shape))
  k, v = read_pages(out, jnp.asarray(pages[:2]))
  np.testing.assert_array_equal(np.asarray(k), new_k[:, :2])
  np.testing.assert_array_equal(np.asarray(v), new_v[:, :2])
