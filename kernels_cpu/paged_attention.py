"""The paged attention custom call for a few queries per row (decode, verification).

`paged_attention(q, k_pages, v_pages, block_tables, q_lens, ...)`: q `[B, T, N,
H]` float32; pages `[P, page_size, K, R]` as the KV pool stores them (float32,
bfloat16 as uint16, or int8 rows of H codes and a float32 scale, R = H + 4);
block_tables `[B, W]` int32 page ids into the pool; q_lens `[B, T]` int32:
query t of row b attends to the row's first `q_lens[b, t]` keys (0: none, the
output is zeros). Returns `[B, T, N, H]` float32. Options: `sliding_window`
(None, a Python int, or a traced int32 scalar, <= 0: none; an operand, so a
scanned layer stack passes its layer's window), `soft_cap` (static), `sinks`
(None, or `[N]` float32 per-head sink logits, GPT-OSS: each joins its head's
softmax denominator and contributes no value).

The kernel (attention.cc) reads each key and value once, in place in its
page, with a running softmax per query head, so nothing is gathered or
transposed; the XLA path copies every block of keys into a dot layout first.
Valid only where `available()` (kernels_cpu/library.py) is True and
`supports(...)` holds for the operands.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu.library import available, target

KINDS = {"float32": 0, "bfloat16": 1, "int8": 2}  # the pool's dtype name -> kernel page kind
MAX_QUERIES = 16  # queries per row it is meant for (prefill chunks go in as one-query rows)
_LANES = 16

__all__ = ["KINDS", "MAX_QUERIES", "available", "paged_attention", "prefill_enabled",
           "supports"]


def prefill_enabled() -> bool:
  """Prefill chunks may take the kernel as one-query rows (`XLASERVE_NATIVE_PREFILL` is not
  0, a switch for comparisons)."""
  return os.environ.get("XLASERVE_NATIVE_PREFILL", "1") != "0"


def supports(q_shape: tuple[int, ...], pages: jax.Array, kv_dtype: str) -> bool:
  """Whether `paged_attention` takes these operands (static shapes and dtypes)."""
  if kv_dtype not in KINDS or len(q_shape) != 4 or pages.ndim != 4:
    return False
  _, t, n, h = q_shape
  stored = {0: jnp.float32, 1: jnp.uint16, 2: jnp.uint8}[KINDS[kv_dtype]]
  row = h + 4 if kv_dtype == "int8" else h
  return (t <= MAX_QUERIES and h % _LANES == 0 and n % pages.shape[2] == 0
          and pages.shape[3] == row and pages.dtype == stored)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, q_lens: jax.Array, *, kv_dtype: str, scale: float,
                    sliding_window: int | jax.Array | None = None,
                    soft_cap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
  """See the module doc; `kv_dtype` names the pool's logical dtype (a `KINDS` key)."""
  call = jax.ffi.ffi_call(target("xlaserve_paged_attention"),
                          jax.ShapeDtypeStruct(q.shape, jnp.float32))
  sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
  window = jnp.reshape(0 if sliding_window is None else sliding_window, (1,)).astype(jnp.int32)
  return call(q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
              q_lens.astype(jnp.int32), sinks, window, scale=np.float32(scale),
              soft_cap=np.float32(soft_cap or 0.0), kind=np.int64(KINDS[kv_dtype]))
