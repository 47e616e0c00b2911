"""One quantized matmul per weight format: the jitted `QuantizedWeight.matmul` alone.

For every format the same random `[In, Out]` weight is quantized (our
quantizers, or gguf-py's blocks for the GGUF types, K-quants from random
blocks since gguf-py has no K-quant quantizer) and `x @ w` is timed for a
decode-like row count and a batch, medians of `--reps` calls after warm-up,
all formats in one process and round-robin. Shapes default to SmolLM2's MLP
down projection (1536 -> 576, ten of them a step at batch 1) and up
projection (576 -> 1536). Reports microseconds and GB/s of weight bytes read.

    PYTHONPATH=. python benchmarks/quant_matmul_bench.py [--rows 1,32] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import gguf as gguf_io
from checkpoints import quantizers
from checkpoints.quantize import gguf_quantized_weight

Q = gguf_io.Q


def _gguf(rows: np.ndarray, qtype) -> object:
  """`[Out, In]` rows as `qtype` blocks (random blocks for K-quants), served as stored."""
  if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # random codes, f16 super-scales (speed only)
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (rows.shape[0], rows.shape[1] // size, nbytes), dtype=np.uint8)
    for at in ((208,) if qtype == Q.Q6_K else (0, 2)):
      d = rng.uniform(-0.004, 0.004, data.shape[:2]).astype(np.float16)
      data[..., at:at + 2] = d[..., None].view(np.uint8)
    data = data.reshape(rows.shape[0], -1)
  else:
    data = gguf.quants.quantize(np.ascontiguousarray(rows), qtype)
  return gguf_quantized_weight(gguf_io.RawTensor(name="w", ggml_type=qtype, shape=rows.shape,
                                                 data=data))


def formats(w: np.ndarray) -> dict[str, object]:
  """name -> a float array [In, Out] or a QuantizedWeight of it."""
  rows = np.ascontiguousarray(w.T)
  out = {"f32": w, "int8 g32 (ours)": quantizers.quantize_weight(w, "int8"),
         "int8 per channel": quantizers.quantize_weight(w, "int8", group_size=0),
         "int4 g64 (ours)": quantizers.quantize_weight(w, "int4"),
         "fp8 per channel": quantizers.quantize_weight(w, "fp8")}
  if w.shape[0] % 256 == 0:
    names = [("Q8_0", Q.Q8_0), ("Q4_1", Q.Q4_1), ("Q5_0", Q.Q5_0), ("Q4_K", Q.Q4_K),
             ("Q5_K", Q.Q5_K), ("Q6_K", Q.Q6_K)]
  else:
    names = [("Q8_0", Q.Q8_0), ("Q4_1", Q.Q4_1), ("Q5_0", Q.Q5_0)]
  out.update({n: _gguf(rows, t) for n, t in names})
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="1536x576,576x1536", help="In x Out, comma-separated")
  ap.add_argument("--rows", default="1,32")
  ap.add_argument("--reps", type=int, default=50)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  matmul = jax.jit(lambda w, x: w.matmul(x) if hasattr(w, "matmul") else x @ w)
  print("| shape | rows | format | MiB | us | GB/s of weights |\n|---|---|---|---|---|---|")
  for shape in args.shapes.split(","):
    d_in, d_out = (int(v) for v in shape.split("x"))
    w = (rng.standard_normal((d_in, d_out)) * 0.02).astype(np.float32)
    table = {k: jax.tree.map(jnp.asarray, v) for k, v in formats(w).items()}
    for rows in (int(r) for r in args.rows.split(",")):
      x = jnp.asarray(rng.standard_normal((rows, d_in)).astype(np.float32))
      times = {k: [] for k in table}
      for v in table.values():
        jax.block_until_ready(matmul(v, x))
      for _ in range(args.reps):
        for k, v in table.items():
          start = time.perf_counter()
          jax.block_until_ready(matmul(v, x))
          times[k].append(time.perf_counter() - start)
      for k, v in table.items():
        nbytes = sum(int(a.nbytes) for a in jax.tree.leaves(v))
        t = statistics.median(times[k])
        print(f"| {shape} | {rows} | {k} | {nbytes / 2**20:.2f} | {t * 1e6:.0f} "
              f"| {nbytes / t / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
  main()
