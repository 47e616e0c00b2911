"""Pallas kernels for xlaserve, each beside its pure-jnp reference.

Public entry points (stable; ``serving/runner/attention.py`` calls them with ``impl``
chosen by platform):

- ``paged_decode_attention``: one query token per sequence.
- ``mla_decode_attention``: one query token per sequence over a latent (MLA) page
  pool (kernels_pallas/mla_decode.py).
- ``ragged_paged_attention``: many query tokens per sequence (prefill, chunked
  prefill, mixed prefill + decode), causal.

KV layout: ``k_pages``, ``v_pages`` are ``[P, page_size, K, H]`` page pools;
page 0 may be a reserved dummy page. With ``kv_quant="int8" | "fp8"`` they are
uint8 ``[P, page_size, K, H + 4]``: each row's H one-byte codes followed by its
float32 scale (4 bytes), dequantized per block inside the kernels. Query head
``n`` uses kv head ``n // G`` with ``G = N // K``. ``impl``: ``"ref"`` (pure
jnp, any platform), ``"tpu"`` (Pallas Mosaic TPU), ``"gpu"`` (Pallas Triton).
``interpret=True`` runs a kernel through the Pallas interpreter (CPU tests).

Per-layer options: ``sliding_window`` is None, a Python int (static) or an
int32 scalar array (traced, e.g. a layer's entry of a per-layer window array
inside ``lax.scan``; ``<= 0`` means no window), passed to the kernels as a
``[1]`` operand; ``sinks`` is None or ``[N]`` float32 per-head sink logits
(GPT-OSS: each joins its head's softmax denominator, with no value).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.mla_decode import mla_decode_attention, ref_mla_decode_attention
from kernels_pallas.paged_attention import (
  common,
  decode_gpu,
  decode_tpu,
  ragged_gpu,
  ragged_tpu,
  validation,
)
from kernels_pallas.paged_attention.reference import (
  ref_paged_decode_attention,
  ref_ragged_paged_attention,
)
from kernels_pallas.paged_attention.tuning import BlockSizes

__all__ = [
  "BlockSizes",
  "mla_decode_attention",
  "paged_decode_attention",
  "ragged_paged_attention",
  "ref_mla_decode_attention",
  "ref_paged_decode_attention",
  "ref_ragged_paged_attention",
]

_STATIC = ("scale", "sliding_window", "soft_cap", "impl", "interpret", "block_sizes",
           "kv_quant")
_DECODE = {"tpu": decode_tpu.paged_decode_attention, "gpu": decode_gpu.paged_decode_attention}
_RAGGED = {"tpu": ragged_tpu.ragged_paged_attention, "gpu": ragged_gpu.ragged_paged_attention}


def _check_platform(impl: str, interpret: bool) -> None:
  """A compiled kernel needs its own platform; say so instead of failing in lowering."""
  backend = jax.default_backend()
  if impl != "ref" and not interpret and backend != impl:
    raise ValueError(f"{impl=} needs a {impl.upper()} backend (default backend is {backend!r}); "
                     "use impl='ref' or interpret=True")


def paged_decode_attention(q, k_pages, v_pages, block_tables, seq_lens, *, scale,
                           sliding_window=None, soft_cap=None, sinks=None, impl="ref",
                           interpret=False, block_sizes: BlockSizes | None = None,
                           kv_quant: str | None = None):
  """Decode attention: one new query token per sequence over its KV pages.

  Args:
    q: [B, N, H] float32 or bfloat16; the query of each sequence, at position
      ``seq_lens[b] - 1``.
    k_pages, v_pages: [P, page_size, K, H] float32 or bfloat16 (both alike, may
      differ from q's: q is cast to it for the dots); N must be a multiple of K.
      With ``kv_quant``: uint8 [P, page_size, K, H + 4], each row H codes then
      its float32 scale's 4 bytes; dequantized to float32 per block (q is cast
      to float32 for the dots).
    block_tables: [B, W] int32 page ids; entries past a sequence's
      ``cdiv(seq_lens[b], page_size)`` pages are never read.
    seq_lens: [B] int32 number of valid keys (including the query's own);
      0 marks a padding row, whose output is zeros.
    scale: logit scale (usually ``H ** -0.5``), static.
    sliding_window: None, or w: keys at positions ``> q_pos - w`` only. A
      Python int is static; an int32 scalar array is traced (``<= 0``: none).
    soft_cap: None, or c: logits become ``c * tanh(logits / c)``.
    sinks: None, or [N] float32 per-head sink logits: one more softmax term
      per head, with no value (GPT-OSS).
    impl: "ref" | "tpu" | "gpu".
    interpret: run the Pallas kernel in interpret mode (ignored for "ref").
    block_sizes: override the tuned ``BlockSizes`` (kernels only).
    kv_quant: None, "int8" or "fp8" (codes int8 or float8_e4m3fn), static.

  Returns:
    [B, N, H] in q's dtype (softmax and accumulation in float32).
  """
  static_window, window = common.split_window(sliding_window)
  validation.check_decode(q, k_pages, v_pages, block_tables, seq_lens, kv_quant)
  validation.check_options(scale, static_window, soft_cap, impl, window)
  validation.check_sinks(sinks, q.shape[1])
  _check_platform(impl, interpret)
  return _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, _window_operand(window),
                       sinks, scale=scale, sliding_window=static_window, soft_cap=soft_cap,
                       impl=impl, interpret=interpret, block_sizes=block_sizes,
                       kv_quant=kv_quant)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, *, scale,
                           sliding_window=None, soft_cap=None, sinks=None, impl="ref",
                           interpret=False, block_sizes: BlockSizes | None = None,
                           kv_quant: str | None = None):
  """Causal attention for a ragged batch of query tokens over paged KV.

  Args:
    q: [T, N, H] float32 or bfloat16; queries of S sequences, flattened.
      Sequence s owns rows ``cu_q_lens[s]:cu_q_lens[s+1]``; rows at or past
      ``cu_q_lens[S]`` are padding (output zeros).
    k_pages, v_pages: [P, page_size, K, H] float32 or bfloat16 (as in
      ``paged_decode_attention``, incl. the quantized layout with ``kv_quant``).
      The new tokens' K/V are already written.
    block_tables: [S, W] int32 page ids; entries past a sequence's
      ``cdiv(kv_lens[s], page_size)`` pages are never read.
    cu_q_lens: [S+1] int32 cumulative query counts, ``cu_q_lens[0] == 0``,
      non-decreasing.
    kv_lens: [S] int32 total keys of each sequence including its new queries;
      query i of sequence s sits at position ``kv_lens[s] - q_len_s + i``.
    scale, sliding_window, soft_cap, sinks, impl, interpret, block_sizes, kv_quant: as
      in ``paged_decode_attention`` (``block_sizes.q_block`` sets the query tile).

  Returns:
    [T, N, H] in q's dtype.
  """
  static_window, window = common.split_window(sliding_window)
  validation.check_ragged(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, kv_quant)
  validation.check_options(scale, static_window, soft_cap, impl, window)
  validation.check_sinks(sinks, q.shape[1])
  _check_platform(impl, interpret)
  return _ragged(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, _window_operand(window),
                 sinks, scale=scale, sliding_window=static_window, soft_cap=soft_cap, impl=impl,
                 interpret=interpret, block_sizes=block_sizes, kv_quant=kv_quant)


def _window_operand(window):
  """A traced window as the kernels' ``[1]`` int32 operand (None stays None)."""
  return None if window is None else jnp.reshape(window, (1,)).astype(jnp.int32)


def _kernel_options(sinks, **kwargs) -> dict:
  """Keyword options of one kernel or reference call (sinks in float32)."""
  return dict(kwargs, sinks=None if sinks is None else sinks.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _paged_decode(q, k_pages, v_pages, block_tables, seq_lens, window, sinks, *, scale,
                  sliding_window, soft_cap, impl, interpret, block_sizes, kv_quant):
  """`paged_decode_attention` after validation, jitted (`window`: None or int32 [1])."""
  kwargs = _kernel_options(sinks, scale=scale, soft_cap=soft_cap, kv_quant=kv_quant)
  if impl == "ref":
    return ref_paged_decode_attention(
      q, k_pages, v_pages, block_tables, seq_lens, **kwargs,
      sliding_window=sliding_window if window is None else window[0])
  return _DECODE[impl](q, k_pages, v_pages, block_tables, seq_lens, **kwargs,
                       sliding_window=sliding_window, window=window, interpret=interpret,
                       block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _ragged(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, window, sinks, *, scale,
            sliding_window, soft_cap, impl, interpret, block_sizes, kv_quant):
  """`ragged_paged_attention` after validation, jitted (`window`: None or int32 [1])."""
  kwargs = _kernel_options(sinks, scale=scale, soft_cap=soft_cap, kv_quant=kv_quant)
  if impl == "ref":
    return ref_ragged_paged_attention(
      q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, **kwargs,
      sliding_window=sliding_window if window is None else window[0])
  return _RAGGED[impl](q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, **kwargs,
                       sliding_window=sliding_window, window=window, interpret=interpret,
                       block_sizes=block_sizes)
