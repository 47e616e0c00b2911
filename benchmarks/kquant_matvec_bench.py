"""GGUF formats at Llama-3.2-1B shapes: the native matvec against the XLA path.

For each GGUF type a random `[Out, In]` tensor of its blocks (gguf-py's
quantizer for Q4_0 / Q8_0, random codes with sane float16 scales for the
K-quants, which gguf-py cannot quantize) is kept as stored
(`gguf_quantized_weight`) and `x @ w` is timed, jitted, for each path:

- `xla`: what `QuantizedWeight.matmul` does without the native kernels
  (dequantize inside the jitted step, then XLA's dot);
- `native f32`: the native kernel with float32 activations;
- `native q8` / `native q16`: activations rounded per group of 32 to 8 / 16
  bits, VNNI integer dot products (`with_activation_bits`).

Medians and minima of `--reps` calls after warm-up, all variants round-robin
in one process (so load from other processes hits them alike; on a shared
machine the minimum is the steadier figure). Shapes default to the
1B MLP: gate/up (2048 -> 8192) and down (8192 -> 2048).

    PYTHONPATH=. python benchmarks/kquant_matvec_bench.py [--rows 1,8] [--reps 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import gguf
import jax
import jax.numpy as jnp
import numpy as np

import kernels_cpu
from checkpoints import gguf as gguf_io
from checkpoints.quantize import gguf_quantized_weight

Q = gguf_io.Q
TYPES = {"Q4_0": Q.Q4_0, "Q8_0": Q.Q8_0, "Q4_K": Q.Q4_K, "Q5_K": Q.Q5_K, "Q6_K": Q.Q6_K}
_SUPER_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def blocks(rng: np.random.Generator, qtype, out_dim: int, in_dim: int) -> np.ndarray:
  """uint8 GGUF blocks of a random `[out_dim, in_dim]` tensor of `qtype`."""
  if qtype not in _SUPER_AT:
    return gguf.quants.quantize((rng.standard_normal((out_dim, in_dim)) * 0.02).astype(
        np.float32), qtype)
  size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
  data = rng.integers(0, 256, (out_dim, in_dim // size, nbytes), dtype=np.uint8)
  for at in _SUPER_AT[qtype]:
    d = rng.uniform(1e-5, 4e-5, data.shape[:2]).astype(np.float16)
    data[..., at:at + 2] = d[..., None].view(np.uint8)
  return data.reshape(out_dim, -1)


def xla_matmul(w, x):
  """`QuantizedWeight.matmul`'s XLA path (the native kernels off)."""
  return jnp.einsum("...i,oi->...o", x, w.after(x).dequantize(jnp.float32),
                    preferred_element_type=jnp.float32)


def variants(w) -> dict[str, tuple]:
  """name -> (function, weight) for every path that applies to `w`."""
  out = {"xla": (jax.jit(xla_matmul), w)}
  native = jax.jit(lambda w, x: w.matmul(x))
  if kernels_cpu.available() and w.runs_native(1):
    out["native f32"] = (native, w)
    if kernels_cpu.matvec.vnni():
      for bits in (8, 16):
        marked = dataclasses.replace(w, activation_bits=bits)
        if marked.native_activation_bits(1) == bits:
          out[f"native q{bits}"] = (native, marked)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="2048x8192,8192x2048", help="In x Out, comma-separated")
  ap.add_argument("--rows", default="1,8")
  ap.add_argument("--types", default=",".join(TYPES))
  ap.add_argument("--reps", type=int, default=30)
  ap.add_argument("--json", default=None, help="also write the results here")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  results = []
  print("| shape (in x out) | rows | type | path | MiB | median us | min us | GB/s (min) "
        "| vs xla (min) |\n|---|---|---|---|---|---|---|---|---|")
  for shape in args.shapes.split(","):
    d_in, d_out = (int(v) for v in shape.split("x"))
    for name in args.types.split(","):
      raw = gguf_io.RawTensor(name="w", ggml_type=TYPES[name], shape=(d_out, d_in),
                              data=blocks(rng, TYPES[name], d_out, d_in))
      w = jax.tree.map(jnp.asarray, gguf_quantized_weight(raw))
      nbytes = w.nbytes
      for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, d_in)).astype(np.float32))
        paths = variants(w)
        for fn, v in paths.values():
          jax.block_until_ready(fn(v, x))
        times = {k: [] for k in paths}
        for _ in range(args.reps):
          for k, (fn, v) in paths.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(v, x))
            times[k].append(time.perf_counter() - start)
        base = min(times["xla"])
        for k in paths:
          t, best = statistics.median(times[k]), min(times[k])
          results.append(dict(shape=shape, rows=rows, type=name, path=k, median_us=t * 1e6,
                              min_us=best * 1e6, mib=nbytes / 2**20))
          print(f"| {shape} | {rows} | {name} | {k} | {nbytes / 2**20:.1f} | {t * 1e6:.0f} "
                f"| {best * 1e6:.0f} | {nbytes / best / 1e9:.1f} | {base / best:.1f}x |",
                flush=True)
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(dict(argv=sys.argv[1:], results=results), f, indent=1)


if __name__ == "__main__":
  main()
