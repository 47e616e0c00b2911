"""The device-side paged KV cache: one page pool for all layers.

Layout: `k`, `v` are `[L * P, page_size, K, H]` — layer `l` owns pages
`[l*P, (l+1)*P)`. Block tables hold per-layer page ids in `[0, P)`; the
attention code offsets them by `l * P`, so kernels see a standard page pool
and the scan over layers never slices (copies) a layer out of the cache.
Page 0 of every layer is reserved as the dummy page that padding tokens
write into; the host allocator never hands it out.

bfloat16 pages are stored as uint16 and bitcast on access (XLA:CPU turns a
scatter into a bf16 buffer into a full-cache convert; see JAX_NOTES.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from serving.model_config import ModelConfig

STORAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.uint16}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: jax.Array  # [L*P, page_size, K, H]
  v: jax.Array  # [L*P, page_size, K, H]
  num_pages: int = dataclasses.field(metadata=dict(static=True))  # P, pages per layer
  dtype: str = dataclasses.field(metadata=dict(static=True))  # logical dtype name

  @property
  def page_size(self) -> int:
    return self.k.shape[1]

  @property
  def compute_dtype(self):
    return jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32


def create_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: str,
                    sharding=None) -> KVCache:
  if dtype not in STORAGE_DTYPES:
    raise ValueError(f"unsupported kv cache dtype {dtype!r}; supported: {list(STORAGE_DTYPES)}")
  shape = (cfg.num_layers * num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
  make = jax.jit(lambda: jnp.zeros(shape, STORAGE_DTYPES[dtype]), out_shardings=sharding)
  return KVCache(k=make(), v=make(), num_pages=num_pages, dtype=dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
  return cfg.kv_bytes_per_token(jnp.dtype(STORAGE_DTYPES[dtype]).itemsize)


def _to_storage(x: jax.Array, kv: KVCache) -> jax.Array:
  if kv.dtype == "bfloat16":
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  return x.astype(jnp.float32)


def from_storage(x: jax.Array, kv: KVCache) -> jax.Array:
  if kv.dtype == "bfloat16":
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
  return x


def write_kv(kv: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array,
             slot_mapping: jax.Array) -> KVCache:
  """Scatters new keys/values [T, K, H] into flat slots `page * page_size + offset`.

  `slot_mapping` [T] int32 is per-layer; padding tokens point into page 0.
  """
  ps = kv.k.shape[1]
  page = layer * kv.num_pages + slot_mapping // ps  # [T]
  off = slot_mapping % ps
  # Index the 4-D pool directly: reshaping it would make XLA copy the cache.
  k = kv.k.at[page, off].set(_to_storage(k_new, kv))
  v = kv.v.at[page, off].set(_to_storage(v_new, kv))
  return dataclasses.replace(kv, k=k, v=v)
