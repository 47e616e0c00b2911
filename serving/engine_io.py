"""Turns scheduler decisions into the runner's fixed-shape numpy inputs.

Every array is padded to a bucket from `EngineConfig` (prefill tokens, decode
rows, block-table width), so the set of shapes the device sees is fixed at
warm-up. Also sizes the KV page pool from the memory budget.
"""

from __future__ import annotations

import jax
import numpy as np

from serving.config import EngineConfig, bucket_for
from serving.kv_cache import kv_bytes_per_token
from serving.model_config import ModelConfig
from serving.runner import DecodeInput, ModelRunner, PrefillInput, resolve_dtypes
from serving.sampling import SamplingTensors
from serving.scheduler import PrefillChunk, Sequence


def _slots_of(seq: Sequence, positions: np.ndarray, page_size: int) -> np.ndarray:
  pages = np.asarray(seq.pages, np.int32)
  return pages[positions // page_size] * page_size + positions % page_size


def build_prefill_input(chunk: PrefillChunk, runner: ModelRunner) -> PrefillInput:
  config = runner.engine_cfg
  seq, n = chunk.seq, chunk.end - chunk.start
  t = bucket_for(n, config.prefill_token_buckets)
  tokens = np.zeros((t,), np.int32)
  tokens[:n] = seq.token_ids()[chunk.start:chunk.end]
  positions = np.zeros((t,), np.int32)
  positions[:n] = np.arange(chunk.start, chunk.end)
  slot_mapping = np.zeros((t,), np.int32)
  slot_mapping[:n] = _slots_of(seq, positions[:n], config.page_size)
  is_output = np.zeros((t,), bool)
  is_output[:n] = positions[:n] >= len(seq.prompt_ids)
  used = -(-chunk.end // config.page_size)
  table = np.zeros((1, config.block_table_width), np.int32)
  table[0, :used] = seq.pages[:used]
  step = seq.num_generated - 1 if chunk.sample else 0
  return PrefillInput(
      tokens=tokens, positions=positions, slot_mapping=slot_mapping, is_output=is_output,
      num_tokens=np.int32(n), block_table=table, kv_len=np.array([chunk.end], np.int32),
      slot=np.int32(seq.slot), reset=np.bool_(chunk.start == 0),
      sampling=SamplingTensors.build([seq.params], [seq.seed], [step], 1))


def build_decode_input(seqs: list[Sequence], runner: ModelRunner) -> DecodeInput:
  config = runner.engine_cfg
  b = bucket_for(len(seqs), config.decode_batch_buckets)
  width = config.block_table_width
  slots = np.full((b,), runner.dummy_slot, np.int32)
  positions = np.zeros((b,), np.int32)
  slot_mapping = np.zeros((b,), np.int32)
  tables = np.zeros((b, width), np.int32)
  seq_lens = np.zeros((b,), np.int32)
  for i, seq in enumerate(seqs):
    pos = seq.num_computed - 1  # the input token (sampled by the previous step)
    slots[i], positions[i], seq_lens[i] = seq.slot, pos, pos + 1
    slot_mapping[i] = _slots_of(seq, np.array([pos]), config.page_size)[0]
    tables[i, :len(seq.pages)] = seq.pages
  return DecodeInput(
      slots=slots, positions=positions, slot_mapping=slot_mapping, block_tables=tables,
      seq_lens=seq_lens,
      sampling=SamplingTensors.build([s.params for s in seqs], [s.seed for s in seqs],
                                     [s.num_generated - 1 for s in seqs], b))


def capacity_pages(model_cfg: ModelConfig, config: EngineConfig) -> int:
  """KV pages from the memory budget, capped at what max_num_seqs can use."""
  _, kv_dtype = resolve_dtypes(config, jax.default_backend())
  page_bytes = config.page_size * kv_bytes_per_token(model_cfg, kv_dtype)
  device = jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    budget = (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * config.kv_cache_memory_fraction
  else:
    import psutil
    budget = psutil.virtual_memory().available * config.kv_cache_memory_fraction
  cap = config.max_num_seqs * config.max_pages_per_seq + 1
  pages = min(int(budget // page_bytes), cap)
  if pages < config.max_pages_per_seq + 1:
    raise ValueError(f"KV budget of {budget / 2**30:.2f} GiB holds {pages} pages; one request at "
                     f"max_model_len={config.max_model_len} needs {config.max_pages_per_seq + 1}. "
                     "Raise kv_cache_memory_fraction or lower max_model_len.")
  return pages
