"""A `StepPlan` -> the steps' fixed-shape numpy inputs.

Every array is padded to a bucket from `EngineConfig` (prefill tokens and
chunk rows, decode rows, block-table width), so the set of shapes the device
sees is fixed at warm-up. Everything is read from the plan when `build_step_inputs` runs, so
the scheduler may move on to the next step afterwards.

Sampling is seeded per request: the output token at index i of a request
with seed s draws from `fold_in(key(s), i)`, whatever batch or row it lands
in. A chunk ending at position `end` samples output index
`end - len(prompt)`; a decode row at input position p samples
`p + 1 - len(prompt)`. A step's prefill chunks are packed into one call (more
only when they overflow the largest bucket).

`window=True` (a hybrid model's runner, kv_cache.py): every call also carries
the KV indices and block tables of the sliding-window page group, from
`Sequence.window_pages` (0, the dummy page, where the window has passed).
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from serving.config import EngineConfig, bucket_for
from serving.runner import attention
from serving.runner.sampling import SamplingTensors
from serving.runner.steps import DecodeInput, PrefillInput, VerifyInput
from serving.types import DecodeRow, LoraAdapter, PrefillChunk, Sequence, StepError, StepPlan


@dataclasses.dataclass
class StepInputs:
  """The device calls of one step: prefill calls (usually one), then one decode batch.

  `prefill_ids[i]` names the requests `prefills[i]` samples, in sampler-row
  order (empty for a call whose chunks all stop mid-prompt); `decode_ids` the
  requests of the decode rows.
  """

  prefills: list[PrefillInput]
  prefill_ids: list[list[str]]
  decode: DecodeInput | None
  decode_ids: list[str]
  lora_loads: list[tuple[int, LoraAdapter]] = dataclasses.field(default_factory=list)
  lora_users: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # slot -> ids
  # Sampled requests with an output constraint: the step samples once their masks come.
  constrained: list[str] = dataclasses.field(default_factory=list)
  # A speculative step runs its decode rows as one verify call instead (`decode` is None):
  # `drafts` [B, S-1] holds host-proposed drafts (zeros where the draft model proposes).
  verify: VerifyInput | None = None
  drafts: np.ndarray | None = None
  # A multi-step decode (StepPlan.decode_steps = k > 1): KV indices [B, k-1] of the
  # decode rows' later iterations (padding: page 0); and in the sliding-window group.
  decode_later: np.ndarray | None = None
  decode_later_window: np.ndarray | None = None


def build_step_inputs(plan: StepPlan, config: EngineConfig, window: bool = False) -> StepInputs:
  """Every input of the plan's device calls (see module doc; `window`: with the
  sliding-window group's indices and tables).

  A sequence whose values cannot be turned into arrays (a request that slipped
  past validation) raises `StepError` naming it, before anything is dispatched.
  """
  prefills, ids = [], []
  for group in pack_prefill_chunks(plan.prefills, config):
    with _blame([c.seq for c in group]):
      inp, sampled = build_prefill_input(group, config, window=window)
    prefills.append(inp)
    ids.append(sampled)
  decode = verify = drafts = later = later_window = None
  if plan.decodes:
    with _blame([r.seq for r in plan.decodes]):
      if plan.speculative:
        verify, drafts = build_verify_input(plan.decodes, config, window)
      elif plan.decode_steps > 1:
        decode, later, later_window = build_multi_decode_input(plan.decodes, plan.decode_steps,
                                                               config, window)
      else:
        decode = build_decode_input(plan.decodes, config, window=window)
  users: dict[int, list[str]] = {}
  for seq in plan.sequences:
    if seq.lora_slot is not None:
      users.setdefault(seq.lora_slot, []).append(seq.request_id)
  return StepInputs(prefills=prefills, prefill_ids=ids, decode=decode,
                    decode_ids=[r.seq.request_id for r in plan.decodes],
                    lora_loads=list(plan.lora_loads), lora_users=users,
                    constrained=plan.constrained, verify=verify, drafts=drafts,
                    decode_later=later, decode_later_window=later_window)


def _lora_slot(seq: Sequence) -> int:
  return -1 if seq.lora_slot is None else seq.lora_slot


@contextlib.contextmanager
def _blame(seqs: list[Sequence]):
  """Turns a failure to build inputs into a StepError naming the sequences at fault:
  those whose own sampling tensors fail to build, else all of `seqs`."""
  try:
    yield
  except Exception as e:  # noqa: BLE001 -- re-raised, attributed
    bad = [s.request_id for s in seqs if not _builds(s)] or [s.request_id for s in seqs]
    raise StepError(f"could not build the step's inputs: {e}", bad) from e


def _builds(seq: Sequence) -> bool:
  try:
    SamplingTensors.build([seq.params], [seq.seed], [0], 1)
  except Exception:  # noqa: BLE001 -- a probe
    return False
  return True


def kv_index(seq: Sequence, positions: np.ndarray, page_size: int,
             window: bool = False) -> np.ndarray:
  """Flat KV-pool index of each position: its page's first entry + the offset in it
  (`window`: in the sliding-window group's pages)."""
  pages = np.asarray(seq.window_pages if window else seq.pages, np.int32)
  return pages[positions // page_size] * page_size + positions % page_size


def _tables(b: int, config: EngineConfig, window: bool) -> tuple[np.ndarray, np.ndarray | None]:
  """Zeroed block tables [B, W] and, with `window`, the sliding-window group's."""
  w = config.block_table_width
  return np.zeros((b, w), np.int32), np.zeros((b, w), np.int32) if window else None


def pack_prefill_chunks(chunks: list[PrefillChunk],
                        config: EngineConfig) -> list[list[PrefillChunk]]:
  """The step's chunks grouped into prefill calls: as many as fit the largest token
  bucket and its chunk rows (the scheduler's budget makes that one call)."""
  sched = config.scheduler
  top = sched.prefill_token_buckets[-1]
  groups: list[list[PrefillChunk]] = []
  tokens = 0
  for chunk in chunks:
    n = chunk.end - chunk.start
    if not groups or tokens + n > top or len(groups[-1]) >= sched.prefill_chunk_rows(top):
      groups.append([])
      tokens = 0
    groups[-1].append(chunk)
    tokens += n
  return groups


def prefill_bucket(sizes: list[int], config: EngineConfig) -> int:
  """The smallest token bucket holding chunks of `sizes` tokens (and their count)."""
  for t in config.scheduler.prefill_token_buckets:
    if sum(sizes) <= t and len(sizes) <= config.scheduler.prefill_chunk_rows(t):
      return t
  raise ValueError(f"{len(sizes)} prefill chunks of {sum(sizes)} tokens exceed the largest "
                   f"bucket {config.scheduler.prefill_token_buckets[-1]}")


def build_prefill_input(chunks: list[PrefillChunk], config: EngineConfig, *,
                        bucket: int | None = None, window: bool = False
                        ) -> tuple[PrefillInput, list[str]]:
  """One prefill call of `chunks` (none: a padding-only call of `bucket` tokens) and
  the requests it samples, in sampler-row order (steps.PrefillInput)."""
  t = bucket or prefill_bucket([c.end - c.start for c in chunks], config)
  c_rows, q = config.scheduler.prefill_chunk_rows(t), attention.PREFILL_QUERY_BLOCK
  nb, ps, dummy = -(-t // q) + c_rows, config.cache.page_size, config.scheduler.max_num_seqs
  tokens, positions, index = (np.zeros((t,), np.int32) for _ in range(3))
  is_output = np.zeros((t,), bool)
  token_slots, lora_rows = np.full((t,), dummy, np.int32), np.full((t,), -1, np.int32)
  cu, kv_lens = np.zeros((c_rows + 1,), np.int32), np.zeros((c_rows,), np.int32)
  tables, window_tables = _tables(c_rows, config, window)
  window_index = np.zeros((t,), np.int32) if window else None
  slots, reset = np.full((c_rows,), dummy, np.int32), np.zeros((c_rows,), bool)
  rows, q_lens = np.zeros((nb, q), np.int32), np.zeros((nb, q), np.int32)
  block_chunk, unblock = np.zeros((nb,), np.int32), np.zeros((t,), np.int32)
  row = blk = 0
  for i, chunk in enumerate(chunks):
    seq, n = chunk.seq, chunk.end - chunk.start
    pos = np.arange(chunk.start, chunk.end, dtype=np.int32)
    span = slice(row, row + n)
    tokens[span] = seq.token_ids()[chunk.start:chunk.end]
    positions[span] = pos
    index[span] = kv_index(seq, pos, ps)
    is_output[span] = pos >= len(seq.prompt_ids)
    token_slots[span], lora_rows[span] = seq.decode_slot, _lora_slot(seq)
    used = -(-chunk.end // ps)
    tables[i, :used] = seq.pages[:used]
    if window:
      window_index[span] = kv_index(seq, pos, ps, window=True)
      window_tables[i, :used] = seq.window_pages[:used]
    kv_lens[i], slots[i], reset[i] = chunk.end, seq.decode_slot, chunk.start == 0
    for b0 in range(0, n, q):  # the chunk's query blocks
      m = min(q, n - b0)
      rows[blk, :m] = row + b0 + np.arange(m)
      q_lens[blk, :m] = pos[b0:b0 + m] + 1
      block_chunk[blk] = i
      unblock[row + b0:row + b0 + m] = blk * q + np.arange(m)
      blk += 1
    row += n
    cu[i + 1:] = row
  sampled = [(i, c) for i, c in enumerate(chunks) if c.sample]
  sample_rows = np.zeros((c_rows,), np.int32)
  sample_slots = np.full((c_rows,), dummy, np.int32)
  for j, (i, chunk) in enumerate(sampled):
    sample_rows[j], sample_slots[j] = cu[i + 1] - 1, chunk.seq.decode_slot
  seqs = [c.seq for _, c in sampled]
  inp = PrefillInput(
      tokens=tokens, positions=positions, kv_index=index, is_output=is_output,
      token_slots=token_slots, lora_rows=lora_rows, cu_q_lens=cu, kv_lens=kv_lens,
      block_tables=tables, decode_slots=slots, reset=reset,
      blocks=attention.QueryBlocks(rows=rows, q_lens=q_lens, chunk=block_chunk,
                                   count=np.int32(blk), unblock=unblock),
      sample_rows=sample_rows, sample_slots=sample_slots,
      sampling=SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs],
                                     [c.end - len(c.seq.prompt_ids) for _, c in sampled],
                                     c_rows),
      window_kv_index=window_index, window_block_tables=window_tables)
  return inp, [s.request_id for s in seqs]


def build_multi_decode_input(rows: list[DecodeRow], steps: int, config: EngineConfig,
                             window: bool = False
                             ) -> tuple[DecodeInput, np.ndarray, np.ndarray | None]:
  """A multi-step decode's first iteration (DecodeInput) and the KV indices [B, steps-1]
  of its later ones (and with `window`, in the sliding-window group); padded to a
  multi-step bucket."""
  inp = build_decode_input(rows, config, buckets=config.scheduler.multi_step_batch_buckets,
                           window=window)
  later = np.zeros((inp.positions.shape[0], steps - 1), np.int32)
  later_window = np.zeros_like(later) if window else None
  for i, row in enumerate(rows):
    pos = row.position + np.arange(1, steps)
    later[i] = kv_index(row.seq, pos, config.cache.page_size)
    if window:
      later_window[i] = kv_index(row.seq, pos, config.cache.page_size, window=True)
  return inp, later, later_window


def build_decode_input(rows: list[DecodeRow], config: EngineConfig,
                       buckets: tuple[int, ...] | None = None, window: bool = False
                       ) -> DecodeInput:
  """One decode call of `rows` (steps.DecodeInput), padded to a batch bucket."""
  b = bucket_for(len(rows), buckets or config.scheduler.decode_batch_buckets)
  slots = np.full((b,), config.scheduler.max_num_seqs, np.int32)  # padding rows: the dummy slot
  positions = np.zeros((b,), np.int32)
  index = np.zeros((b,), np.int32)
  tables, window_tables = _tables(b, config, window)
  window_index = np.zeros((b,), np.int32) if window else None
  seq_lens = np.zeros((b,), np.int32)
  lora_slots = np.full((b,), -1, np.int32)
  for i, row in enumerate(rows):
    seq, pos = row.seq, row.position
    slots[i], positions[i], seq_lens[i] = seq.decode_slot, pos, pos + 1
    lora_slots[i] = _lora_slot(seq)
    index[i] = kv_index(seq, np.array([pos]), config.cache.page_size)[0]
    tables[i, :len(seq.pages)] = seq.pages
    if window:
      window_index[i] = kv_index(seq, np.array([pos]), config.cache.page_size, window=True)[0]
      window_tables[i, :len(seq.window_pages)] = seq.window_pages
  return DecodeInput(
      decode_slots=slots, positions=positions, kv_index=index, block_tables=tables,
      seq_lens=seq_lens, lora_slots=lora_slots,
      sampling=SamplingTensors.build([r.seq.params for r in rows], [r.seq.seed for r in rows],
                                     [r.position + 1 - len(r.seq.prompt_ids) for r in rows], b),
      window_kv_index=window_index, window_block_tables=window_tables)


def build_verify_input(rows: list[DecodeRow], config: EngineConfig,
                       window: bool = False) -> tuple[VerifyInput, np.ndarray]:
  """A speculative step's input and its host drafts [B, S-1] (S = drafts + 1 per row)."""
  b = bucket_for(len(rows), config.verify_batch_buckets)
  s = config.speculative.num_speculative_tokens + 1
  slots = np.full((b,), config.scheduler.max_num_seqs, np.int32)  # padding rows: the dummy slot
  positions = np.zeros((b,), np.int32)
  num_drafts = np.zeros((b,), np.int32)
  index = np.zeros((b, s), np.int32)  # positions past a row's drafts write to page 0
  tables, window_tables = _tables(b, config, window)
  window_index = np.zeros((b, s), np.int32) if window else None
  lora_slots = np.full((b,), -1, np.int32)
  prev_tokens = np.zeros((b,), np.int32)
  prev_index = np.zeros((b,), np.int32)
  drafts = np.zeros((b, s - 1), np.int32)
  for i, row in enumerate(rows):
    seq, pos, n = row.seq, row.position, row.num_drafts
    slots[i], positions[i], num_drafts[i] = seq.decode_slot, pos, n
    lora_slots[i] = _lora_slot(seq)
    index[i, :n + 1] = kv_index(seq, pos + np.arange(n + 1), config.cache.page_size)
    tables[i, :len(seq.pages)] = seq.pages
    if window:
      window_index[i, :n + 1] = kv_index(seq, pos + np.arange(n + 1), config.cache.page_size,
                                         window=True)
      window_tables[i, :len(seq.window_pages)] = seq.window_pages
    drafts[i, :len(row.drafts)] = row.drafts
    if pos > 0:
      prev_tokens[i] = seq.token_ids()[pos - 1]
      prev_index[i] = kv_index(seq, np.array([pos - 1]), config.cache.page_size)[0]
  inp = VerifyInput(
      decode_slots=slots, positions=positions, num_drafts=num_drafts, kv_index=index,
      block_tables=tables, lora_slots=lora_slots, prev_tokens=prev_tokens,
      prev_kv_index=prev_index,
      sampling=SamplingTensors.build([r.seq.params for r in rows], [r.seq.seed for r in rows],
                                     [r.position + 1 - len(r.seq.prompt_ids) for r in rows], b),
      window_kv_index=window_index, window_block_tables=window_tables)
  return inp, drafts
