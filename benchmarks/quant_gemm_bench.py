"""The native quantized kernel against XLA's dense dots, by activation row count.

For each `[In, Out]` shape (SmolLM2-135M's MLP and head, Llama-3.2-1B's MLP by
default) and row count, times `kernels_cpu.quantized_matvec` on random codes
(speed only) in each format and activation precision, and XLA's float32 dot on
a dense float32 copy and on a bfloat16 copy with float32 accumulation (what a
dequantized copy costs today, `layers.dot_f32_accumulate`). Every variant is a
jitted call timed round-robin with the others (the machine is shared: each
round times every variant once, back to back), and the median over `--reps`
rounds is reported as GFLOP/s (2 * rows * In * Out per call).

`--cpu-time` divides by the process's CPU time instead of wall time: on a shared,
overloaded machine that is what a call costs in core-seconds (run it with one
thread each: XLASERVE_NATIVE_THREADS=1 and XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1").

    PYTHONPATH=. python benchmarks/quant_gemm_bench.py [--rows 1,8,32,128,512] \
        [--shapes 576x1536,1536x576,576x49152,2048x8192,8192x2048] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_cpu import matvec

# name -> (code bits, signed one-byte codes, has a min, activation bits)
VARIANTS = {"U8 a32": (8, False, True, 32), "Q8_0 a32": (8, True, False, 32),
            "Q8_0 a16": (8, True, False, 16), "Q8_0 a8": (8, True, False, 8),
            "Q4_1 a32": (4, False, True, 32), "Q4_0 a32": (4, False, False, 32),
            "Q4_0 a16": (4, False, False, 16), "Q4_0 a8": (4, False, False, 8)}
# Integer variants also timed with the AMX tiles off (XLASERVE_NATIVE_AMX=0, read by the
# library at each call): "<variant> noAMX".
NO_AMX = " noAMX"


def _operands(rng, d_in: int, d_out: int, bits: int, signed: bool, has_min: bool):
  """Random codes, float16 scales (and mins) for an `[Out, In]` weight."""
  groups = d_in // 32
  if bits == 4:
    codes = rng.integers(0, 256, (d_out, d_in // 2), dtype=np.uint8)
  elif signed:
    codes = rng.integers(-127, 128, (d_out, d_in), dtype=np.int8)
  else:
    codes = rng.integers(0, 256, (d_out, d_in), dtype=np.uint8)
  scale = rng.uniform(1e-4, 1e-3, (d_out, groups)).astype(np.float16)
  offset = rng.uniform(-0.05, 0.0, (d_out, groups)).astype(np.float16) if has_min else None
  return jnp.asarray(codes), jnp.asarray(scale), None if offset is None else jnp.asarray(offset)


def _callables(rng, d_in: int, d_out: int, names: list[str]) -> dict[str, tuple]:
  """name -> (jitted fn, weight operands) for the XLA dots and the native variants."""
  w = jnp.asarray((rng.standard_normal((d_in, d_out)) * 0.02).astype(np.float32))
  out = {"XLA f32": (jax.jit(lambda x, w: jnp.dot(x, w)), (w,)),
         "XLA bf16": (jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w,
                                                   preferred_element_type=jnp.float32)),
                      (w.astype(jnp.bfloat16),))}
  for name in names:
    bits, signed, has_min, act = VARIANTS[name.removesuffix(NO_AMX)]
    if act != 32 and not matvec.vnni():
      continue
    ops = _operands(rng, d_in, d_out, bits, signed, has_min)
    fn = jax.jit(lambda x, c, s, m, bits=bits, act=act: matvec.quantized_matvec(
        x, c, s, m, bits=bits, activation_bits=act))
    out[name] = (_without_amx(fn) if name.endswith(NO_AMX) else fn, ops)
  return out


def _without_amx(fn):
  """fn called with XLASERVE_NATIVE_AMX=0 in the environment (the kernels' VNNI tiles)."""
  def call(*args):
    os.environ["XLASERVE_NATIVE_AMX"] = "0"
    try:
      return jax.block_until_ready(fn(*args))
    finally:
      del os.environ["XLASERVE_NATIVE_AMX"]
  return call


def _time(fn, x, ops, clock=time.perf_counter) -> float:
  start = clock()
  jax.block_until_ready(fn(x, *ops))
  return clock() - start


def main() -> None:
  """Prints one markdown table row per shape and row count: GFLOP/s per variant."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="576x1536,1536x576,576x49152,2048x8192,8192x2048",
                  help="In x Out, comma-separated")
  ap.add_argument("--rows", default="1,8,32,128,512")
  ap.add_argument("--variants", default=",".join(VARIANTS),
                  help=f"comma-separated; an integer one + '{NO_AMX}': with the AMX tiles off")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--cpu-time", action="store_true", help="GFLOP per CPU second")
  args = ap.parse_args()
  clock = time.process_time if args.cpu_time else time.perf_counter
  if not matvec.available():
    raise SystemExit("native kernels not available")
  rng = np.random.default_rng(0)
  names = args.variants.split(",")
  header = None
  for shape in args.shapes.split(","):
    d_in, d_out = (int(v) for v in shape.split("x"))
    table = _callables(rng, d_in, d_out, names)
    if header is None:
      header = list(table)
      print("| In x Out | rows | " + " | ".join(header) + " |")
      print("|---|---|" + "---|" * len(header))
    for rows in (int(r) for r in args.rows.split(",")):
      x = jnp.asarray(rng.standard_normal((rows, d_in)).astype(np.float32))
      times = {k: [] for k in table}
      for fn, ops in table.values():  # compile and warm up
        _time(fn, x, ops)
      for _ in range(args.reps):
        for k, (fn, ops) in table.items():
          times[k].append(_time(fn, x, ops, clock))
      flops = 2.0 * rows * d_in * d_out
      cells = [f"{flops / statistics.median(times[k]) / 1e9:.1f}" for k in header]
      print(f"| {d_in}x{d_out} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
