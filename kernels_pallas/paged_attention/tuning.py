"""Block sizes for the paged-attention kernels, as data.

One table per (backend, op). Keys are ``page_size``; values are the block
sizes a kernel uses when the caller does not pass its own. ``lookup`` clamps
them to the call's shapes. Figures marked "untuned" are chosen from the memory
hierarchy (about 128 keys per TPU block, 64-128 per Triton block, TPU query
blocks of 128 rows) and wait for a device run of ``benchmarks/device_check.sh``
to be replaced by measured optima. See docs/kernels.md.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Static block sizes of one kernel launch.

  pages_per_block: KV pages gathered per kernel step (keys per step =
    pages_per_block * page_size).
  q_block: query tokens per tile (ragged kernels only).
  kv_heads_per_block: TPU only; 0 picks the smallest lane-aligned block (see
    ``common.kv_heads_per_block``), K fetches whole pages contiguously.
  num_splits: GPU decode only; key-range splits per (sequence, kv head), 0
    for automatic (enough programs to fill the GPU).
  num_warps, num_stages: Triton launch parameters (GPU kernels only).
  """

  pages_per_block: int
  q_block: int = 0
  kv_heads_per_block: int = 0
  num_splits: int = 0
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.pages_per_block < 1:
      raise ValueError(f"{self.pages_per_block=} must be >= 1")
    if min(self.q_block, self.kv_heads_per_block, self.num_splits) < 0:
      raise ValueError(f"block sizes must be >= 0: {self}")


# (impl, op) -> {page_size: BlockSizes}. All untuned (no device run yet).
TABLE: dict[tuple[str, str], dict[int, BlockSizes]] = {
  ("tpu", "decode"): {
    16: BlockSizes(pages_per_block=8),
    32: BlockSizes(pages_per_block=4),
    64: BlockSizes(pages_per_block=2),
  },
  ("tpu", "ragged"): {
    16: BlockSizes(pages_per_block=8, q_block=128),
    32: BlockSizes(pages_per_block=4, q_block=128),
    64: BlockSizes(pages_per_block=2, q_block=128),
  },
  ("gpu", "decode"): {
    16: BlockSizes(pages_per_block=8, num_warps=4, num_stages=2),
    32: BlockSizes(pages_per_block=4, num_warps=4, num_stages=2),
    64: BlockSizes(pages_per_block=2, num_warps=4, num_stages=2),
  },
  # q_block is in query *rows* of the stacked [q_block * G, H] tile: the GPU
  # kernel divides it by the padded GQA group size.
  ("gpu", "ragged"): {
    16: BlockSizes(pages_per_block=4, q_block=64, num_warps=4, num_stages=2),
    32: BlockSizes(pages_per_block=2, q_block=64, num_warps=4, num_stages=2),
    64: BlockSizes(pages_per_block=1, q_block=64, num_warps=4, num_stages=2),
  },
}

# Used for page sizes missing from a table: about 128 keys per step.
_DEFAULT_KEYS_PER_BLOCK = 128
_DEFAULT_Q_BLOCK = {"tpu": 128, "gpu": 64}


def lookup(impl: str, op: str, page_size: int, pages_per_seq: int) -> BlockSizes:
  """Block sizes for one call, clamped so a block never exceeds the block table."""
  if (impl, op) not in TABLE:
    raise ValueError(f"no tuning table for {impl=} {op=}")
  sizes = TABLE[impl, op].get(page_size)
  if sizes is None:
    sizes = BlockSizes(
      pages_per_block=max(1, _DEFAULT_KEYS_PER_BLOCK // page_size),
      q_block=_DEFAULT_Q_BLOCK[impl] if op == "ragged" else 0,
    )
  ppb = min(sizes.pages_per_block, pages_per_seq)
  if impl == "gpu":
    # Triton tensors need power-of-two sizes.
    ppb = 1 << (ppb.bit_length() - 1)
  return dataclasses.replace(sizes, pages_per_block=ppb)
