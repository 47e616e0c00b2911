"""Input checks shared by every paged-attention entry point.

Each check raises ``ValueError`` (wrong shape, rank or option) or ``TypeError``
(wrong dtype) naming the offending argument, before anything is traced into a
kernel. They only look at static shapes and dtypes, so they are free under jit.
"""

from __future__ import annotations

import jax.numpy as jnp

IMPLS = ("ref", "tpu", "gpu")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_pages(q, k_pages, v_pages) -> tuple[int, int, int, int]:
  """Checks q / k_pages / v_pages agree; returns (num_pages, page_size, K, H)."""
  if k_pages.ndim != 4:
    raise ValueError(f"k_pages must be [pages, page_size, kv_heads, head_dim], got {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
  for name, x in (("q", q), ("k_pages", k_pages)):
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
      raise TypeError(f"{name} dtype must be float32 or bfloat16, got {x.dtype}")
  if v_pages.dtype != k_pages.dtype:
    raise TypeError(f"v_pages dtype {v_pages.dtype} must match k_pages dtype {k_pages.dtype}")
  num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
  num_q_heads = q.shape[-2]
  if q.shape[-1] != head_dim:
    raise ValueError(f"q head_dim {q.shape[-1]} != k_pages head_dim {head_dim}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"q heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
  return num_pages, page_size, num_kv_heads, head_dim


def _check_int_vector(name: str, x, length: int) -> None:
  if x.dtype != jnp.int32:
    raise TypeError(f"{name} must be int32, got {x.dtype}")
  if x.shape != (length,):
    raise ValueError(f"{name} must have shape ({length},), got {x.shape}")


def _check_block_tables(block_tables, rows: int) -> None:
  if block_tables.dtype != jnp.int32:
    raise TypeError(f"block_tables must be int32, got {block_tables.dtype}")
  if block_tables.ndim != 2 or block_tables.shape[0] != rows or block_tables.shape[1] < 1:
    raise ValueError(f"block_tables must be [{rows}, pages_per_seq>=1], got {block_tables.shape}")


def check_options(scale, sliding_window, soft_cap, impl) -> None:
  """Checks the keyword options common to decode and ragged attention."""
  if not isinstance(scale, (int, float)) or scale <= 0:
    raise ValueError(f"scale must be a positive Python number, got {scale!r}")
  if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
    raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
  if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or soft_cap <= 0):
    raise ValueError(f"soft_cap must be None or a positive number, got {soft_cap!r}")
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def check_decode(q, k_pages, v_pages, block_tables, seq_lens) -> None:
  """Validates paged decode attention inputs (see ``paged_decode_attention``)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got {q.shape}")
  _check_pages(q, k_pages, v_pages)
  batch = q.shape[0]
  _check_block_tables(block_tables, batch)
  _check_int_vector("seq_lens", seq_lens, batch)


def check_ragged(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens) -> None:
  """Validates ragged paged attention inputs (see ``ragged_paged_attention``)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [tokens, q_heads, head_dim], got {q.shape}")
  _check_pages(q, k_pages, v_pages)
  if kv_lens.ndim != 1:
    raise ValueError(f"kv_lens must be [num_seqs], got {kv_lens.shape}")
  num_seqs = kv_lens.shape[0]
  _check_int_vector("kv_lens", kv_lens, num_seqs)
  _check_int_vector("cu_q_lens", cu_q_lens, num_seqs + 1)
  _check_block_tables(block_tables, num_seqs)
