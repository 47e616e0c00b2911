"""Ragged tile schedule and TPU index maps: coverage and page isolation.

Interpret mode clamps out-of-range reads, so reading a garbage block-table
entry whose compute is then skipped would not show in kernel outputs. These
tests evaluate the TPU index maps directly over the whole grid and check that
every page they request belongs to the sequence (or is page 0 for rows with
no keys).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import decode_tpu, ragged_tpu, tiles


@pytest.mark.parametrize(
  "q_lens, num_tokens, q_block",
  [((5, 1, 16), 32, 8), ((0, 0), 8, 8), ((8, 8), 16, 8), ((1, 0, 9, 3, 0), 24, 8),
   ((30,), 30, 16), ((3, 4, 5, 6, 7), 40, 16)],
)
def test_tiles_cover_every_row_once(q_lens, num_tokens, q_block):
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  sched = tiles.ragged_tiles(jnp.asarray(cu), num_tokens, q_block)
  seq, qblk, first = (np.asarray(x) for x in (sched.seq, sched.q_block, sched.first))
  num_seqs = len(q_lens)
  assert len(seq) == tiles.num_tiles(num_tokens, num_seqs, q_block)
  assert (np.diff(qblk) >= 0).all(), "tiles of one query block must be consecutive"
  owner = np.full(num_tokens, -1)
  zeroed = np.zeros(num_tokens, bool)
  for s, b, f in zip(seq, qblk, first, strict=True):
    rows = np.arange(b * q_block, min((b + 1) * q_block, num_tokens))
    if f:
      zeroed[rows] = True
    if s < num_seqs:
      mine = rows[(rows >= cu[s]) & (rows < cu[s + 1])]
      assert mine.size, f"real tile ({s=}, {b=}) owns no rows"
      assert (owner[mine] == -1).all(), "a row is owned by two tiles"
      owner[mine] = s
  expected = np.repeat(np.arange(num_seqs), q_lens)
  np.testing.assert_array_equal(owner[: cu[-1]], expected)
  assert (owner[cu[-1]:] == -1).all() and zeroed.all()


def _own_pages(tables, lens, page_size):
  return [set(tables[s, : -(-n // page_size)].tolist()) for s, n in enumerate(lens)]


@pytest.mark.parametrize("window", [None, 7])
def test_decode_tpu_index_maps_read_only_own_pages(window):
  page_size, ppb, width = 4, 2, 5
  lens = np.array([0, 1, 27, 4, 9, 20], np.int32)  # 27 > width * page_size: stays in its row
  tables = np.full((len(lens), width), -99, np.int32)  # garbage everywhere ...
  for s, n in enumerate(lens):
    used = min(-(-n // page_size), width)
    tables[s, :used] = 10 * (s + 1) + np.arange(used)  # ... but here
  own = _own_pages(tables, lens, page_size)
  flat, lens_j = jnp.asarray(tables.reshape(-1)), jnp.asarray(lens)
  for slot in range(ppb):
    index_map = jax.jit(decode_tpu._page_index_map(ppb, page_size, width, window, slot))
    for b, blk in itertools.product(range(len(lens)), range(-(-width // ppb))):
      page, _, _ = index_map(b, 0, blk, flat, lens_j)
      assert int(page) in (own[b] or {0}), (b, blk, slot, int(page))


def test_ragged_tpu_index_maps_read_only_own_pages():
  page_size, ppb, width, q_block = 4, 2, 6, 8
  q_lens, kv_lens = [3, 0, 9, 1], [10, 5, 9, 24]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
  tables = np.full((len(kv_lens), width), 12345, np.int32)
  for s, n in enumerate(kv_lens):
    tables[s, : -(-n // page_size)] = 10 * (s + 1) + np.arange(-(-n // page_size))
  own = _own_pages(tables, kv_lens, page_size)
  sched = tiles.ragged_tiles(cu, 16, q_block)
  refs = (jnp.asarray(tables.reshape(-1)), cu, jnp.asarray(kv_lens, jnp.int32), sched.seq,
          sched.q_block, sched.first)
  for window, slot in itertools.product([None, 3], range(ppb)):
    index_map = jax.jit(ragged_tpu._page_index_map(
      slot, pages_per_block=ppb, page_size=page_size, pages_per_seq=width, q_block=q_block,
      num_seqs=len(kv_lens), sliding_window=window))
    for t, blk in itertools.product(range(sched.seq.shape[0]), range(-(-width // ppb))):
      page, _, _ = index_map(0, t, blk, *refs)
      s = int(sched.seq[t])
      allowed = own[s] if s < len(kv_lens) else {0}
      assert int(page) in allowed, (t, blk, slot, int(page))
