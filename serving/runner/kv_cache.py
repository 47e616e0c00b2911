"""The device-side paged KV cache: one page pool for all layers.

Layout: `k`, `v` are `[L * P, page_size, K, H]` — layer `l` owns pages
`[l*P, (l+1)*P)`. Block tables hold per-layer page ids in `[0, P)`; the
attention code offsets them by `l * P`, so kernels see a standard page pool
and the scan over layers never slices (copies) a layer out of the cache.
Page 0 of every layer is reserved as the dummy page that padding tokens
write into; the host allocator never hands it out.

bfloat16 pages are stored as uint16 and bitcast on access (XLA:CPU turns a
scatter into a bf16 buffer into a full-cache convert: 325-470 ms a step,
against 0.04 ms for the uint16 bitcast; docs/performance.md).

int8 / fp8 (e4m3) pages are quantized per token per head: each `[H]` row is
stored as uint8 `[H + 4]`, H codes followed by the row's float32 scale
(bitcast), so `k`, `v` are `[L*P, page_size, K, H + 4]`. Keeping the scale
beside its row means one scatter per write and one gather per page read, and
the attention code needs no extra operands: `write_kv` quantizes and
`from_storage` dequantizes a gathered block (docs/quantization.md). The
Pallas kernels take the quantized pool as stored (`kv_quant`) and dequantize
each block they load.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys

import jax
import jax.numpy as jnp

from serving.models.model_config import ModelConfig

STORAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.uint16, "int8": jnp.uint8,
                  "fp8": jnp.uint8}
QUANTIZED_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # code, max
SCALE_BYTES = 4  # float32 scale stored after each quantized [H] row


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

  @property
  def head_dim(self) -> int:
    return self.k.shape[-1] - (SCALE_BYTES if self.dtype in QUANTIZED_DTYPES else 0)


def create_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: str,
                    sharding=None) -> KVCache:
  if dtype not in STORAGE_DTYPES:
    raise ValueError(f"unsupported kv cache dtype {dtype!r}; supported: {list(STORAGE_DTYPES)}")
  row = cfg.head_dim + (SCALE_BYTES if dtype in QUANTIZED_DTYPES else 0)
  shape = (cfg.num_layers * num_pages, page_size, cfg.num_kv_heads, row)
  make = jax.jit(lambda: jnp.zeros(shape, STORAGE_DTYPES[dtype]), out_shardings=sharding)
  kv = KVCache(k=make(), v=make(), num_pages=num_pages, dtype=dtype)
  for pool in (kv.k, kv.v):
    release_zero_pages(pool)
  return kv


def release_zero_pages(pool: jax.Array) -> int:
  """Hands the memory pages of an all-zero host pool back to the OS; returns the bytes.

  On XLA:CPU (Linux) a buffer is private anonymous memory: `madvise(MADV_DONTNEED)`
  unmaps its pages and the next touch faults in a fresh zero page, so the pool
  still reads as zeros while its resident memory grows only with the pages
  attention writes, as llama.cpp's calloc'd cache does (creating the pool wrote
  every byte). Only the page-aligned interior of each buffer is released; the
  pool must be all zeros. Elsewhere (accelerators, other systems) a no-op."""
  libc = _libc()
  if libc is None or pool.is_deleted():
    return 0
  pool.block_until_ready()
  released = 0
  for shard in pool.addressable_shards:
    if shard.device.platform != "cpu":
      return released
    start = shard.data.unsafe_buffer_pointer()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + shard.data.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first),
                                    _MADV_DONTNEED) == 0:
      released += end - first
  return released


_MADV_DONTNEED = 4  # Linux


def _libc():
  if not sys.platform.startswith("linux"):
    return None
  try:
    return ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
  if dtype in QUANTIZED_DTYPES:  # 1-byte codes + a float32 scale per token per head
    return 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + SCALE_BYTES)
  return cfg.kv_bytes_per_token(jnp.dtype(STORAGE_DTYPES[dtype]).itemsize)


def _to_storage(x: jax.Array, kv: KVCache) -> jax.Array:
  if kv.dtype == "bfloat16":
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
  if kv.dtype in QUANTIZED_DTYPES:
    return quantize_rows(x, kv.dtype)
  return x.astype(jnp.float32)


def from_storage(x: jax.Array, kv: KVCache) -> jax.Array:
  if kv.dtype == "bfloat16":
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16)
  if kv.dtype in QUANTIZED_DTYPES:
    return dequantize_rows(x, kv.dtype)
  return x


def quantize_rows(x: jax.Array, dtype: str) -> jax.Array:
  """x [..., H] -> uint8 [..., H + 4]: codes scaled by the row's absmax, then the scale."""
  code_dtype, qmax = QUANTIZED_DTYPES[dtype]
  xf = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(xf), axis=-1) / qmax  # [...]
  inv = jnp.where(scale > 0, 1.0 / scale, 0.0)[..., None]
  scaled = jnp.clip(xf * inv, -qmax, qmax)
  codes = jnp.round(scaled).astype(code_dtype) if dtype == "int8" else scaled.astype(code_dtype)
  codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
  scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.uint8)  # [..., 4]
  return jnp.concatenate([codes, scale_bytes], axis=-1)


def dequantize_rows(x: jax.Array, dtype: str) -> jax.Array:
  """uint8 [..., H + 4] (see `quantize_rows`) -> float32 [..., H]."""
  code_dtype, _ = QUANTIZED_DTYPES[dtype]
  codes = jax.lax.bitcast_convert_type(x[..., :-SCALE_BYTES], code_dtype).astype(jnp.float32)
  scale = jax.lax.bitcast_convert_type(x[..., -SCALE_BYTES:], jnp.float32)  # [...]
  return codes * scale[..., None]


def write_kv(kv: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array,
             kv_index: jax.Array) -> KVCache:
  """Scatters new keys/values [T, K, H] into flat slots `page * page_size + offset`.

  `kv_index` [T] int32 is per-layer; padding tokens point into page 0.
  """
  ps = kv.k.shape[1]
  page = layer * kv.num_pages + kv_index // ps  # [T]
  off = kv_index % ps
  # Index the 4-D pool directly: reshaping it would make XLA copy the cache.
  k = kv.k.at[page, off].set(_to_storage(k_new, kv))
  v = kv.v.at[page, off].set(_to_storage(v_new, kv))
  return dataclasses.replace(kv, k=k, v=v)


def page_rows(kv: KVCache, pages: jax.Array) -> jax.Array:
  """Rows of the pool [L * n] holding `pages` [n] of every layer, layer-major."""
  layers = kv.k.shape[0] // kv.num_pages
  return (jnp.arange(layers, dtype=jnp.int32)[:, None] * kv.num_pages + pages[None, :]).reshape(-1)


def read_pages(kv: KVCache, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The stored K and V of `pages` [n] in every layer -> two [L, n, page_size, K, H'] arrays
  (as stored: quantized rows keep their codes and scales). Disaggregated serving
  moves a prefix's pages between engines with this and `write_pages`."""
  rows = page_rows(kv, pages)
  shape = (-1, pages.shape[0], *kv.k.shape[1:])
  return kv.k[rows].reshape(shape), kv.v[rows].reshape(shape)


def write_pages(kv: KVCache, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
  """Writes `read_pages`' output into `pages` [n] of every layer (page 0, the dummy
  page, may take padding)."""
  rows = page_rows(kv, pages)
  k = kv.k.at[rows].set(k.reshape(-1, *kv.k.shape[1:]).astype(kv.k.dtype))
  v = kv.v.at[rows].set(v.reshape(-1, *kv.v.shape[1:]).astype(kv.v.dtype))
  return dataclasses.replace(kv, k=k, v=v)
