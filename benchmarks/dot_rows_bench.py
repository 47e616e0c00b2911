"""XLA:CPU matmul speed by row count and weight dtype, on SmolLM2's layer shapes.

Times one jitted program holding the seven matmuls of every layer (q, k, v,
o, gate, up, down; 30 layers) at each row count, for float32 weights, bfloat16
weights with float32 accumulation (`layers.linear`'s formulation, without its
one-row padding) and int8 weights with int8 activations accumulated in int32.
It is the measurement behind `layers.dot_f32_accumulate` padding a single
bfloat16 row to two (docs/performance.md).

  python benchmarks/dot_rows_bench.py [--rows 1,2,4,8,32] [--calls 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, KV, LAYERS = 576, 1536, 192, 30
SHAPES = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # [In, Out]


def _f32(x, w):
  return jnp.dot(x, w)


def _bf16(x, w):
  return jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)


def _int8(x, w):
  scale = jnp.max(jnp.abs(x)) / 127.0
  xq = jnp.round(x / scale).astype(jnp.int8)
  return jnp.dot(xq, w, preferred_element_type=jnp.int32).astype(jnp.float32) * scale


FORMATS = {"float32": (_f32, np.float32), "bfloat16": (_bf16, jnp.bfloat16),
           "int8": (_int8, np.int8)}


def program(matmul):
  @jax.jit
  def run(weights, x_d, x_f):
    total = jnp.float32(0)
    for layer in weights:
      for w in layer:
        total = total + matmul(x_d if w.shape[0] == D else x_f, w).sum()
    return total
  return run


def weights_for(dtype, rng):
  if dtype == np.int8:
    return [[jnp.asarray(rng.integers(-127, 128, s, dtype=np.int8)) for s in SHAPES]
            for _ in range(LAYERS)]
  return [[jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype) for s in SHAPES]
          for _ in range(LAYERS)]


def time_ms(fn, args, calls: int) -> float:
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="1,2,4,8,32")
  ap.add_argument("--calls", type=int, default=20)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  rows = [int(r) for r in args.rows.split(",")]
  print(f"{'rows':>4} " + " ".join(f"{name + ' ms':>12}" for name in FORMATS))
  progs = {name: (program(mm), weights_for(dt, rng)) for name, (mm, dt) in FORMATS.items()}
  for m in rows:
    x_d = jnp.asarray(rng.standard_normal((m, D), dtype=np.float32))
    x_f = jnp.asarray(rng.standard_normal((m, F), dtype=np.float32))
    cells = [time_ms(fn, (w, x_d, x_f), args.calls) for fn, w in progs.values()]
    print(f"{m:4d} " + " ".join(f"{c:12.1f}" for c in cells), flush=True)


if __name__ == "__main__":
  main()
