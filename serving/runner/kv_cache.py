"""The device-side paged KV cache: one page pool for all layers.

Layout: `k`, `v` are `[L * P, page_size, K, H]` — layer `l` owns pages
`[l*P, (l+1)*P)`. Block tables hold per-layer page ids in `[0, P)`; the
attention code offsets them by `l * P`, so kernels see a standard page pool
and the scan over layers never slices (copies) a layer out of the cache.
A latent cache (MLA models, `ModelConfig.mla`): `k` holds one
`[kv_lora_rank + qk_rope_head_dim]` row per token per layer (one KV head: the
normed latent and the roped key), `v` is an empty `[..., 0]` pool
(serving/runner/mla_attention.py). Page 0 of every layer is reserved as the
dummy page that padding tokens write into; the host allocator never hands it
out.

Hybrid models (full-attention and sliding-window layers, `KVLayout`): the
layers form two page groups, each with its own page ids — full layers `P`
pages each, sliding layers `Pw` (fewer: a sequence holds only the pages its
window reads; the host's `WindowPages` releases the others). The pool is
still one array per k / v, layer after layer in layer order, `L_full * P +
L_sliding * Pw` pages: layer `l` owns the rows from `layout.bases[l]`. A step
carries a second KV index and block table for the sliding group
(`window_kv_index`, `window_block_tables`: the same positions in its page
ids, 0 behind the window — the dummy page, which the window masks), and
`layer_pages` picks a layer's index and layer-offset tables from small
static per-layer arrays indexed by the (traced) layer id. Without a layout
(every other model, and hybrid ones whose window spans max_model_len or that
run pipeline stages: `kv_layout`) nothing of this exists: one group, the
`[L * P]` pool, the tables as before.

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

from serving.config import EngineConfig
from serving.models.model_config import ModelConfig

STORAGE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.uint16, "int8": jnp.uint8,
                  "fp8": jnp.uint8}
QUANTIZED_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # code, max
SCALE_BYTES = 4  # float32 scale stored after each quantized [H] row


NO_WINDOW = 2 ** 30  # a full-attention layer's window where windows are traced per layer


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """A hybrid model's two page groups in the pool (module doc): static."""

  sliding: tuple[bool, ...]  # per layer: in the sliding-window group
  num_pages: int  # P: pages of each full-attention layer (page 0 included)
  window_pages: int  # Pw: pages of each sliding-window layer (page 0 included)
  window: int  # the sliding layers' window, in tokens

  @property
  def bases(self) -> tuple[int, ...]:
    """Each layer's first row in the pool."""
    out, row = [], 0
    for sliding in self.sliding:
      out.append(row)
      row += self.window_pages if sliding else self.num_pages
    return tuple(out)

  @property
  def rows(self) -> int:
    """Pages in the pool, every layer's."""
    return sum(self.window_pages if s else self.num_pages for s in self.sliding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: jax.Array  # [L*P, page_size, K, H] (a layout: [layout.rows, ...])
  v: jax.Array  # [L*P, page_size, K, H]
  num_pages: int = dataclasses.field(metadata=dict(static=True))  # P, pages per layer
  dtype: str = dataclasses.field(metadata=dict(static=True))  # logical dtype name
  layout: KVLayout | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def page_size(self) -> int:
    return self.k.shape[1]

  @property
  def compute_dtype(self):
    return jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32

  @property
  def head_dim(self) -> int:
    return self.k.shape[-1] - (SCALE_BYTES if self.dtype in QUANTIZED_DTYPES else 0)


def layout_note(cfg: ModelConfig, config: EngineConfig) -> str | None:
  """Why a model with a sliding window keeps every page in one group, if it does for a
  reason worth a log line: its window covers max_model_len (every layer then sees the
  whole sequence), or a hybrid model runs pipeline stages (they split the pool evenly
  by layer)."""
  window, max_len = cfg.sliding_window, config.scheduler.max_model_len
  if window is not None and window >= max_len:
    return (f"sliding window {window} >= max_model_len {max_len}: served as full attention "
            "(one KV page group)")
  if cfg.is_hybrid and config.parallel.pp > 1:
    return (f"hybrid attention with pipeline stages (pp={config.parallel.pp}): one KV page "
            "group, the pages behind the window are kept")
  return None


def kv_layout(cfg: ModelConfig, config: EngineConfig, num_pages: int) -> KVLayout | None:
  """The pool's page groups for `num_pages` full-attention pages (None: one group): a
  hybrid model's sliding-window group of `window_group_pages` pages, unless
  `layout_note` gives a reason to keep one group."""
  if not cfg.is_hybrid or layout_note(cfg, config) is not None:
    return None
  window = cfg.sliding_window
  sliding = tuple(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
  return KVLayout(sliding=sliding, num_pages=num_pages, window=window,
                  window_pages=window_group_pages(window, config, num_pages))


def window_group_pages(window: int, config: EngineConfig, num_pages: int) -> int:
  """Pages of the sliding-window group (page 0 included): what `max_num_seqs` sequences
  can hold at once — each its window and the tokens it computes ahead of it (drafts,
  multi-step decoding) plus two partly used pages — and two steps of prefill chunks
  (a chunk's pages are released once the next step has published their hashes);
  never more than the full group's. Fewer would make the group, not the full pages,
  decide preemption; more would only keep more released pages cached."""
  sched, ps = config.scheduler, config.cache.page_size
  ahead = sched.num_decode_steps - 1
  if config.speculative.enabled:
    ahead = max(ahead, config.speculative.num_speculative_tokens)
  per_seq = -(-(window + ahead) // ps) + 2
  chunks = 2 * -(-sched.max_num_batched_tokens // ps)
  return min(num_pages, 1 + sched.max_num_seqs * per_seq + chunks)


def create_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: str,
                    sharding=None, layout: KVLayout | None = None) -> KVCache:
  """The zeroed pool of `num_pages` pages per layer (`layout`: per group)."""
  if dtype not in STORAGE_DTYPES:
    raise ValueError(f"unsupported kv cache dtype {dtype!r}; supported: {list(STORAGE_DTYPES)}")
  row = cfg.head_dim + (SCALE_BYTES if dtype in QUANTIZED_DTYPES else 0)
  rows = layout.rows if layout is not None else cfg.num_layers * num_pages
  shape = (rows, page_size, cfg.num_kv_heads, row)
  make = jax.jit(lambda shape: jnp.zeros(shape, STORAGE_DTYPES[dtype]), static_argnums=0,
                 out_shardings=sharding)
  # A latent cache (MLA) keeps one row per token in `k`; `v` is an empty [.., 0] pool.
  v_shape = shape[:-1] + (0,) if cfg.mla is not None else shape
  kv = KVCache(k=make(shape), v=make(v_shape), num_pages=num_pages, dtype=dtype, layout=layout)
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
  """KV bytes of one token in every layer."""
  if dtype in QUANTIZED_DTYPES and cfg.mla is not None:  # one latent row, codes + scale
    return cfg.num_layers * (cfg.head_dim + SCALE_BYTES)
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


def layer_base(kv: KVCache, layer: jax.Array | int) -> jax.Array | int:
  """The pool row of the layer's page 0."""
  if kv.layout is None:
    return layer * kv.num_pages
  return jnp.asarray(kv.layout.bases, jnp.int32)[layer]


def layer_pages(kv: KVCache, layer: jax.Array | int, meta: dict
                ) -> tuple[jax.Array, jax.Array]:
  """A layer's (kv_index [T], block tables [.., W] offset to its rows) from a step's
  attention metadata: with a layout, the sliding group's index and tables on its
  layers (module doc). `layer` counts the layers of this pool (a pipeline stage's
  own); a Python int selects statically."""
  if kv.layout is None:
    return meta["kv_index"], meta["block_tables"] + layer * kv.num_pages
  if isinstance(layer, int):
    group = "window_" if kv.layout.sliding[layer] else ""
    return meta[group + "kv_index"], meta[group + "block_tables"] + layer_base(kv, layer)
  sliding = jnp.asarray(kv.layout.sliding)[layer]
  index = jnp.where(sliding, meta["window_kv_index"], meta["kv_index"])
  tables = jnp.where(sliding, meta["window_block_tables"], meta["block_tables"])
  return index, tables + layer_base(kv, layer)


def write_kv(kv: KVCache, layer: jax.Array, k_new: jax.Array, v_new: jax.Array,
             kv_index: jax.Array) -> KVCache:
  """Scatters new keys/values [T, K, H] into flat slots `page * page_size + offset`.

  `kv_index` [T] int32 is per-layer (of the layer's group: `layer_pages`); padding
  tokens point into page 0.
  """
  ps = kv.k.shape[1]
  page = layer_base(kv, layer) + kv_index // ps  # [T]
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
  layers = kv.k.shape[0] // kv.num_pages
  return (kv.k[rows].reshape(layers, pages.shape[0], *kv.k.shape[1:]),
          kv.v[rows].reshape(layers, pages.shape[0], *kv.v.shape[1:]))


def write_pages(kv: KVCache, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
  """Writes `read_pages`' output into `pages` [n] of every layer (page 0, the dummy
  page, may take padding; a page named twice keeps its last slot).

  One in-place slice update per page, all its layers at once, rather than a scatter of
  L * n rows: XLA:CPU ran the scatter (with a relayout copy of its updates) at ~4x the
  time of the loop for a 32-page chunk of the default model (docs/kv_offload.md)."""
  layers = kv.k.shape[0] // kv.num_pages

  def put(pool: jax.Array, new: jax.Array) -> jax.Array:
    by_layer = pool.reshape(layers, kv.num_pages, *pool.shape[1:])
    new = new.astype(pool.dtype)

    def page(i, p):
      return jax.lax.dynamic_update_slice_in_dim(
          p, jax.lax.dynamic_slice_in_dim(new, i, 1, axis=1), pages[i], axis=1)

    return jax.lax.fori_loop(0, pages.shape[0], page, by_layer).reshape(pool.shape)

  return dataclasses.replace(kv, k=put(kv.k, k), v=put(kv.v, v))
