"""The latent (MLA) paged decode kernel against its pure-jnp reference and against the
engine's XLA loop (serving/runner/mla_attention.py): in Pallas interpret mode on CPU,
compiled (Triton) on a CUDA GPU (benchmarks/device_check.sh), skipped elsewhere.

Rows of different lengths (0, inside one page, across page blocks, the whole
table), shuffled page ids, NaN in every page no row owns (a kernel reading a
foreign or stale page would leak it), more heads than one head block, float32 and
bfloat16 pools.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import mla_decode
from serving.runner.kv_cache import KVCache
from serving.runner.mla_attention import latent_multi_query_attention

LATENT, ROPE, PAGE, WIDTH = 32, 8, 8, 6
LENS = [0, 5, 8, 21, 48]


def _interpret() -> bool:
  backend = jax.default_backend()
  if backend not in ("cpu", "gpu"):
    pytest.skip(f"the latent decode kernel has no {backend} lowering")
  return backend == "cpu"


def _case(heads: int, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  b = len(LENS)
  num_pages = 1 + b * WIDTH
  pages = rng.normal(size=(num_pages, PAGE, 1, LATENT + ROPE)).astype(np.float32)
  order = rng.permutation(np.arange(1, num_pages))
  tables = np.zeros((b, WIDTH), np.int32)
  owned = set()
  for i, n in enumerate(LENS):
    used = -(-n // PAGE)
    tables[i, :used] = order[i * WIDTH:i * WIDTH + used]
    owned.update(tables[i, :used].tolist())
  for p in set(range(num_pages)) - owned:
    pages[p] = np.nan
  q = rng.normal(size=(b, heads, LATENT + ROPE)).astype(np.float32)
  return (jnp.asarray(q, dtype), jnp.asarray(pages, dtype), jnp.asarray(tables),
          jnp.asarray(LENS, jnp.int32))


@pytest.mark.parametrize("heads,dtype,tol", [(4, jnp.float32, 1e-5), (20, jnp.float32, 1e-5),
                                             (4, jnp.bfloat16, 3e-2)])
def test_kernel_matches_reference_and_xla_loop(heads, dtype, tol):
  q, pages, tables, lens = _case(heads, dtype)
  kw = dict(scale=0.3, value_dim=LATENT)
  got = mla_decode.mla_decode_attention(q, pages, tables, lens, interpret=_interpret(),
                                        pages_per_block=2, **kw)
  ref = mla_decode.ref_mla_decode_attention(q, pages, tables, lens, **kw)
  assert got.shape == (len(LENS), heads, LATENT) and got.dtype == dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                             atol=tol, rtol=tol)
  assert not np.asarray(got[0], np.float32).any()  # no keys: zeros
  if dtype == jnp.float32:
    kv = KVCache(k=pages, v=jnp.zeros((*pages.shape[:3], 0)), num_pages=pages.shape[0],
                 dtype="float32")
    loop = latent_multi_query_attention(q[:, None], kv, tables, lens[:, None],
                                        block_tokens=2 * PAGE, **kw)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(loop), atol=tol, rtol=tol)


def test_shapes_it_refuses():
  assert mla_decode.supports((2, 4, 40), (9, 8, 1, 40), 32)
  assert not mla_decode.supports((2, 4, 44), (9, 8, 1, 44), 32)  # rope dim 12
  q, pages, tables, lens = _case(4, jnp.float32)
  with pytest.raises(ValueError, match="power-of-two latent"):
    mla_decode.mla_decode_attention(q[..., :36], pages[..., :36], tables, lens, scale=1.0,
                                     value_dim=28, interpret=_interpret())
