"""The native kernels' two instruction sets side by side: a decode step's fused decoder stack.

Random SmolLM2-135M-shaped layers (30 x hidden 576, 9 / 3 heads of 64, FFN 1536) in
Q4_1 groups of 32 with 16-bit activations (the default preset's decode), one row with
`--context` keys in a float32 pool; `native_decode.run_layers` jitted once per set
(kernels_cpu/library.py `XLASERVE_NATIVE_ISA`: avx512, avx2), then timed alternately,
`--reps` rounds of `--calls` calls; medians of the per-round medians. Prints JSON.

  PYTHONPATH=. python benchmarks/native_isa_bench.py [--reps 7] [--context 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import quantizers
from kernels_cpu import library
from serving.models import quantized
from serving.models.model_config import ModelConfig
from serving.runner import native_decode
from serving.runner.kv_cache import create_kv_cache

CFG = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=100000.0)
SHAPES = {"wq": (576, 576), "wk": (576, 192), "wv": (576, 192), "wo": (576, 576),
          "w_gate": (576, 1536), "w_up": (576, 1536), "w_down": (1536, 576)}
PAGE_SIZE = 16


def layers(activation_bits: int) -> list[dict]:
  """Random Q4_1 layers (the default model's format) with RMSNorm weights."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(CFG.num_layers):
    lp = {name: jax.tree.map(jnp.asarray, quantizers.quantize_int4(
        (rng.standard_normal(shape) * 0.05).astype(np.float32), 32))
          for name, shape in SHAPES.items()}
    lp = quantized.with_activation_bits(lp, activation_bits)
    lp["attn_norm"] = jnp.ones((576,), jnp.float32)
    lp["mlp_norm"] = jnp.ones((576,), jnp.float32)
    out.append(lp)
  return out


def step_inputs(context: int):
  """One row at position `context` over pages 0.. of a float32 pool."""
  pages = context // PAGE_SIZE + 1
  kv = create_kv_cache(CFG, pages + 1, PAGE_SIZE, "float32")
  table = jnp.arange(pages, dtype=jnp.int32)[None]
  meta = dict(kv_index=jnp.asarray([context], jnp.int32), block_tables=table,
              seq_lens=jnp.asarray([context + 1], jnp.int32))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 576)), jnp.float32)
  return x, jnp.asarray([context], jnp.int32), meta, kv


def compiled_for(isa: str, lp, inputs):
  """run_layers traced and compiled with `isa`'s targets."""
  os.environ["XLASERVE_NATIVE_ISA"] = isa
  library.isa.cache_clear()
  jax.clear_caches()
  x, positions, meta, kv = inputs
  fn = jax.jit(native_decode.run_layers, static_argnums=1)
  assert (f"xlaserve_decode_layers_{isa}" in str(jax.make_jaxpr(
      native_decode.run_layers, static_argnums=1)(lp, CFG, x, positions, meta, kv))
          ) == (isa == "avx2")
  return fn.lower(lp, CFG, x, positions, meta, kv).compile()


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--context", type=int, default=128)
  ap.add_argument("--activation_bits", type=int, default=16)
  args = ap.parse_args()
  lp = layers(args.activation_bits)
  inputs = step_inputs(args.context)
  isas = [i for i in library.ISAS if i in library.usable_isas()]
  calls = {isa: compiled_for(isa, lp, inputs) for isa in isas}
  x, positions, meta, kv = inputs
  rounds = {isa: [] for isa in isas}
  for _ in range(args.reps):
    for isa in isas:
      jax.block_until_ready(calls[isa](lp, x, positions, meta, kv))
      times = []
      for _ in range(args.calls):
        start = time.perf_counter()
        jax.block_until_ready(calls[isa](lp, x, positions, meta, kv))
        times.append(time.perf_counter() - start)
      rounds[isa].append(statistics.median(times) * 1e3)
  result = {"what": "fused decoder stack, one row, ms per step (median of round medians)",
            "context": args.context, "activation_bits": args.activation_bits,
            "ms": {isa: statistics.median(r) for isa, r in rounds.items()}, "rounds": rounds}
  if "avx512" in rounds and "avx2" in rounds:
    result["avx2_speed_vs_avx512"] = result["ms"]["avx512"] / result["ms"]["avx2"]
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
