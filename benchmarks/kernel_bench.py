"""Paged attention micro-benchmark: decode K/V bytes/s, prefill FLOP/s.

``--op decode`` (default) times one jitted ``paged_decode_attention`` call
(median of ``--reps`` timed calls after warm-up) and reports the K/V bytes the
call must read (``sum(seq_lens) * K * H * 2 * itemsize``) per second and as a
fraction of the device's peak memory bandwidth: ~27 GB/s on this project's
CPU machines, ~4.3 TB/s (measured copy) on an H200. ``--op ragged`` times a
full causal prefill of ``batch`` sequences of ``context`` tokens through
``ragged_paged_attention`` and reports attention FLOP/s (``4 * N * H`` per
visible query-key pair) against ~80 GFLOP/s (CPU f32) or ~790 TFLOP/s (H200
bf16 dense).

``--sliding_window w`` limits each query to its last w keys (the work counts
only those), ``--traced_window`` passes w as a jit argument (the per-layer
window of a scanned layer stack), ``--sinks`` adds per-head sink logits
(GPT-OSS). Defaults: on GPU a Llama-3-8B-like layer (32 q heads, 8 kv heads, head dim
128, bf16, batch 64, context 2048, page size 16) for ``ref`` (XLA) and
``gpu`` (Triton); on CPU a tiny shape for ``ref``, plus the Pallas kernels in
interpret mode with ``--interpret`` (correctness path, not a speed figure).

  python benchmarks/kernel_bench.py [--op ragged] [--batch 64 --context 2048 ...] \
    [--impls ref,gpu] [--output out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import BlockSizes, paged_decode_attention, ragged_paged_attention
from serving.tools import run_record

PEAK_GBPS = {"cpu": 27.0, "gpu": 4300.0}  # gpu: H200 measured copy bandwidth
PEAK_TFLOPS = {"cpu": 0.08, "gpu": 790.0}  # cpu: f32 GEMM in jax; gpu: H200 bf16 dense
GPU_DEFAULTS = dict(batch=64, q_heads=32, kv_heads=8, head_dim=128, context=2048, page_size=16,
                    dtype="bfloat16")
CPU_DEFAULTS = dict(batch=8, q_heads=9, kv_heads=3, head_dim=64, context=512, page_size=16,
                    dtype="float32")


def make_inputs(seed, *, batch, q_heads, kv_heads, head_dim, context, page_size, dtype):
  """Full-context sequences on shuffled pages of a pool with one dummy page."""
  pages_per_seq = -(-context // page_size)
  num_pages = 1 + batch * pages_per_seq
  kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
  shape = (num_pages, page_size, kv_heads, head_dim)
  k_pages = jax.random.normal(kk, shape, dtype)
  v_pages = jax.random.normal(kv, shape, dtype)
  perm = 1 + jax.random.permutation(kp, num_pages - 1)
  tables = perm.reshape(batch, pages_per_seq).astype(jnp.int32)
  q = jax.random.normal(kq, (batch, q_heads, head_dim), dtype)
  seq_lens = jnp.full((batch,), context, jnp.int32)
  return q, k_pages, v_pages, tables, seq_lens


def time_call(fn, args, reps):
  """Median seconds of ``reps`` calls after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def make_prefill_inputs(seed, *, batch, context, **shape):
  """``batch`` whole prompts of ``context`` tokens, flattened: q [batch * context, N, H]."""
  q, k_pages, v_pages, tables, seq_lens = make_inputs(seed, batch=batch, context=context,
                                                      **shape)
  q = jax.random.normal(jax.random.key(seed + 1), (batch * context, *q.shape[1:]), q.dtype)
  cu_q_lens = jnp.arange(batch + 1, dtype=jnp.int32) * context
  return q, k_pages, v_pages, tables, cu_q_lens, seq_lens


def visible_keys(lens, window: int) -> int:
  """Query-key pairs a causal prefill of sequences of ``lens`` tokens visits (window 0:
  none): query i sees min(i + 1, window) keys."""
  pairs = 0
  for n in lens:
    seen = np.arange(1, n + 1)
    pairs += int(np.sum(np.minimum(seen, window) if window else seen))
  return pairs


def run(op, impls, shape, *, reps, interpret, block_sizes=None, window=0, traced=False,
        sinks=False):
  """Times each impl; returns result rows with the work unit per second."""
  scale = shape["head_dim"] ** -0.5
  itemsize = jnp.dtype(shape["dtype"]).itemsize
  if op == "decode":
    args = make_inputs(0, **shape)
    attention = paged_decode_attention
    lens = np.asarray(args[-1])
    keys = int(np.sum(np.minimum(lens, window) if window else lens))
    work = keys * shape["kv_heads"] * shape["head_dim"] * 2 * itemsize
  else:
    args = make_prefill_inputs(0, **shape)
    attention = ragged_paged_attention
    work = 4 * shape["q_heads"] * shape["head_dim"] * visible_keys(
      [shape["context"]] * shape["batch"], window)
  options = dict(scale=scale, sliding_window=window or None)
  if sinks:
    options["sinks"] = jax.random.normal(jax.random.key(7), (shape["q_heads"],), jnp.float32)
  if traced:  # the window as a jit argument, as in a scanned layer stack
    args = (jnp.int32(window), *args)
  rows, first_out = [], None
  for impl in impls:
    interp = interpret and impl != "ref"
    sizes = None if impl == "ref" else block_sizes
    if traced:
      fn = jax.jit(lambda w, *a, impl=impl, interp=interp, sizes=sizes: attention(
        *a, **dict(options, sliding_window=w), impl=impl, interpret=interp, block_sizes=sizes))
    else:
      fn = jax.jit(lambda *a, impl=impl, interp=interp, sizes=sizes: attention(
        *a, **options, impl=impl, interpret=interp, block_sizes=sizes))
    seconds = time_call(fn, args, reps)
    out = np.asarray(fn(*args), np.float32)
    if first_out is None:
      first_out = out
    rows.append(dict(impl=impl, interpret=interp, ms=seconds * 1e3, work=work,
                     per_second=work / seconds,
                     max_abs_diff_vs_first=float(np.max(np.abs(out - first_out)))))
  return rows


def main():
  backend = jax.default_backend()
  defaults = GPU_DEFAULTS if backend == "gpu" else CPU_DEFAULTS
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  for name, value in defaults.items():
    parser.add_argument(f"--{name}", type=type(value), default=value)
  parser.add_argument("--op", choices=("decode", "ragged"), default="decode")
  parser.add_argument("--impls", default="ref,gpu" if backend == "gpu" else "ref",
                      help="comma-separated impls: ref, gpu, tpu")
  parser.add_argument("--interpret", action="store_true",
                      help="run the Pallas kernels in interpret mode (CPU)")
  parser.add_argument("--pages_per_block", type=int, default=0,
                      help="kernel block sizes (tuning sweeps); 0: the tuned table")
  parser.add_argument("--q_block", type=int, default=0)
  parser.add_argument("--num_splits", type=int, default=0)
  parser.add_argument("--kv_heads_per_block", type=int, default=0)
  parser.add_argument("--sliding_window", type=int, default=0, help="0: no window")
  parser.add_argument("--traced_window", action="store_true",
                      help="pass the window as a jit argument (a scanned layer's window)")
  parser.add_argument("--sinks", action="store_true", help="per-head sink logits (GPT-OSS)")
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--peak_gbps", type=float, default=PEAK_GBPS.get(backend, 27.0))
  parser.add_argument("--peak_tflops", type=float, default=PEAK_TFLOPS.get(backend, 0.08))
  parser.add_argument("--output", default="", help="write the results as JSON here")
  run_record.add_flags(parser)
  opts = parser.parse_args()
  shape = {name: getattr(opts, name) for name in defaults}
  shape["dtype"] = jnp.dtype(shape["dtype"])
  block_sizes = None
  if opts.pages_per_block:
    block_sizes = BlockSizes(pages_per_block=opts.pages_per_block, q_block=opts.q_block,
                             num_splits=opts.num_splits,
                             kv_heads_per_block=opts.kv_heads_per_block)
  if opts.traced_window and not opts.sliding_window:
    parser.error("--traced_window needs --sliding_window")
  rows = run(opts.op, opts.impls.split(","), shape, reps=opts.reps, interpret=opts.interpret,
             block_sizes=block_sizes, window=opts.sliding_window, traced=opts.traced_window,
             sinks=opts.sinks)
  attn = dict(sliding_window=opts.sliding_window, traced_window=opts.traced_window,
              sinks=opts.sinks)
  # decode: bytes -> GB/s; ragged: FLOPs -> GFLOP/s
  unit, peak = ("GB/s", opts.peak_gbps) if opts.op == "decode" else ("GFLOP/s",
                                                                      opts.peak_tflops * 1e3)
  for r in rows:
    r["rate"] = r["per_second"] / 1e9
    r["unit"] = unit
    r["peak_fraction"] = r["rate"] / peak
  device = jax.devices()[0].device_kind
  print(f"# paged {opts.op}, {device}, jax {jax.__version__}, peak {peak:g} {unit}, "
        f"{ {k: str(v) for k, v in shape.items()} }, {attn}, "
        f"block sizes {block_sizes or 'tuned'}")
  print(f"{'impl':<14}{'ms':>10}{unit:>10}{'of peak':>9}{'max|diff|':>11}")
  for r in rows:
    name = r["impl"] + (" (interp)" if r["interpret"] else "")
    print(f"{name:<14}{r['ms']:>10.3f}{r['rate']:>10.2f}{r['peak_fraction']:>9.1%}"
          f"{r['max_abs_diff_vs_first']:>11.2e}")
  if opts.output:
    record = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  jax=jax.__version__, device=device, backend=backend, op=opts.op,
                  shape={k: str(v) for k, v in shape.items()}, attention=attn, reps=opts.reps,
                  block_sizes=str(block_sizes or "tuned"), results=rows)
    with open(opts.output, "w") as f:
      json.dump(record, f, indent=2)
  if opts.record:
    setup = dict(op=opts.op, device=device, backend=backend, impls=opts.impls,
                 interpret=opts.interpret, shape={k: str(v) for k, v in shape.items()},
                 attention=attn, reps=opts.reps, block_sizes=str(block_sizes or "tuned"),
                 peak=f"{peak:g} {unit}")
    run_record.write_record("kernel_bench", run_record.command_line(), setup, {"impls": rows},
                            results_dir=opts.results_dir)


if __name__ == "__main__":
  main()
