"""Input checks shared by every paged-attention entry point.

Each check raises ``ValueError`` (wrong shape, rank or option) or ``TypeError``
(wrong dtype) naming the offending argument, before anything is traced into a
kernel. They only look at static shapes and dtypes, so they are free under jit.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.paged_attention import common

IMPLS = ("ref", "tpu", "gpu")
KV_QUANTS = (None, "int8", "fp8")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_pages(q, k_pages, v_pages, kv_quant) -> tuple[int, int, int, int]:
  """Checks q / k_pages / v_pages agree; returns (num_pages, page_size, K, H).

  Quantized pages (``kv_quant``) are uint8 ``[..., H + 4]``: H codes, then the
  row's float32 scale as 4 bytes.
  """
  if kv_quant not in KV_QUANTS:
    raise ValueError(f"kv_quant must be one of {KV_QUANTS}, got {kv_quant!r}")
  if k_pages.ndim != 4:
    raise ValueError(f"k_pages must be [pages, page_size, kv_heads, head_dim], got {k_pages.shape}")
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
  if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
    raise TypeError(f"q dtype must be float32 or bfloat16, got {q.dtype}")
  if kv_quant is None and jnp.dtype(k_pages.dtype) not in FLOAT_DTYPES:
    raise TypeError(f"k_pages dtype must be float32 or bfloat16, got {k_pages.dtype} "
                    "(quantized uint8 pages need kv_quant='int8' or 'fp8')")
  if kv_quant is not None and k_pages.dtype != jnp.uint8:
    raise TypeError(f"kv_quant={kv_quant!r} needs uint8 k_pages [..., head_dim + 4], "
                    f"got {k_pages.dtype}")
  if v_pages.dtype != k_pages.dtype:
    raise TypeError(f"v_pages dtype {v_pages.dtype} must match k_pages dtype {k_pages.dtype}")
  num_pages, page_size, num_kv_heads, row = k_pages.shape
  head_dim = row - common.SCALE_BYTES if kv_quant else row
  num_q_heads = q.shape[-2]
  if kv_quant and q.shape[-1] != head_dim:
    raise ValueError(f"kv_quant={kv_quant!r} pages hold head_dim codes + {common.SCALE_BYTES} "
                     f"scale bytes per row: q head_dim {q.shape[-1]} needs k_pages last dim "
                     f"{q.shape[-1] + common.SCALE_BYTES}, got {row}")
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


def check_options(scale, sliding_window, soft_cap, impl, window=None) -> None:
  """Checks the keyword options common to decode and ragged attention: the static
  ``sliding_window`` and the traced ``window`` of ``common.split_window``."""
  if not isinstance(scale, (int, float)) or scale <= 0:
    raise ValueError(f"scale must be a positive Python number, got {scale!r}")
  if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
    raise ValueError(f"sliding_window must be None, a positive int or an int32 scalar array, "
                     f"got {sliding_window!r}")
  if window is not None and (not jnp.issubdtype(window.dtype, jnp.integer) or window.size != 1):
    raise ValueError(f"a traced sliding_window must be one integer, got {window.dtype} "
                     f"{window.shape}")
  if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or soft_cap <= 0):
    raise ValueError(f"soft_cap must be None or a positive number, got {soft_cap!r}")
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def check_sinks(sinks, num_q_heads: int) -> None:
  """``sinks``: None, or float ``[num_q_heads]`` per-head sink logits."""
  if sinks is None:
    return
  if sinks.shape != (num_q_heads,):
    raise ValueError(f"sinks must have shape ({num_q_heads},) (one per query head), "
                     f"got {sinks.shape}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be a float array, got {sinks.dtype}")


def check_decode(q, k_pages, v_pages, block_tables, seq_lens, kv_quant=None) -> None:
  """Validates paged decode attention inputs (see ``paged_decode_attention``)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, q_heads, head_dim], got {q.shape}")
  _check_pages(q, k_pages, v_pages, kv_quant)
  batch = q.shape[0]
  _check_block_tables(block_tables, batch)
  _check_int_vector("seq_lens", seq_lens, batch)


def check_ragged(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, kv_quant=None) -> None:
  """Validates ragged paged attention inputs (see ``ragged_paged_attention``)."""
  if q.ndim != 3:
    raise ValueError(f"q must be [tokens, q_heads, head_dim], got {q.shape}")
  _check_pages(q, k_pages, v_pages, kv_quant)
  if kv_lens.ndim != 1:
    raise ValueError(f"kv_lens must be [num_seqs], got {kv_lens.shape}")
  num_seqs = kv_lens.shape[0]
  _check_int_vector("kv_lens", kv_lens, num_seqs)
  _check_int_vector("cu_q_lens", cu_q_lens, num_seqs + 1)
  _check_block_tables(block_tables, num_seqs)
