"""Latent (MLA) paged decode attention: the Pallas kernel against the engine's XLA loop
and the pure-jnp reference, at a DeepSeek-V3 layer's per-device shape.

Default shape: 16 heads (DeepSeek-V3's 128 over tp = 8), latent 512 + rope 64,
bfloat16 pages of 16 tokens, batch 32, every row at `--context` keys. Prints one
line per implementation: median ms per call over `--reps` after a warm-up call,
and the latent bytes it must read (GB/s). Writes the lines as JSON to `--output`.

  python benchmarks/mla_bench.py --impls kernel,xla,ref
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import mla_decode
from serving.runner.kv_cache import KVCache
from serving.runner.mla_attention import latent_multi_query_attention


def _inputs(a):
  """q, pages, tables, lens for the arguments' shape (random, bf16 / f32)."""
  dtype = jnp.dtype(a.dtype)
  pages_per_seq = a.context // a.page_size
  num_pages = 1 + a.batch * pages_per_seq
  key = jax.random.PRNGKey(0)
  kq, kp = jax.random.split(key)
  row = a.latent + a.rope
  q = jax.random.normal(kq, (a.batch, a.heads, row), jnp.float32).astype(dtype)
  pages = jax.random.normal(kp, (num_pages, a.page_size, 1, row), jnp.float32).astype(dtype)
  tables = (1 + np.random.default_rng(0).permutation(num_pages - 1)).reshape(a.batch, -1)
  lens = jnp.full((a.batch,), a.context, jnp.int32)
  return q, pages, jnp.asarray(tables, jnp.int32), lens


def _fn(impl: str, a):
  kw = dict(scale=(a.latent // 4 + a.rope) ** -0.5, value_dim=a.latent)
  if impl == "kernel":
    return jax.jit(lambda q, p, t, n: mla_decode.mla_decode_attention(
        q, p, t, n, interpret=a.interpret, **kw))
  if impl == "ref":
    return jax.jit(lambda q, p, t, n: mla_decode.ref_mla_decode_attention(q, p, t, n, **kw))
  dtype = "bfloat16" if a.dtype == "bfloat16" else "float32"

  def xla(q, p, t, n):
    pool = jax.lax.bitcast_convert_type(p, jnp.uint16) if dtype == "bfloat16" else p
    kv = KVCache(k=pool, v=jnp.zeros((*p.shape[:3], 0), pool.dtype), num_pages=p.shape[0],
                 dtype=dtype)
    return latent_multi_query_attention(q[:, None], kv, t, n[:, None],
                                        block_tokens=min(128, a.context),
                                        **kw)[:, 0]
  return jax.jit(xla)


def main() -> None:
  """Times each implementation (module doc)."""
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--impls", default="kernel,xla,ref")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--latent", type=int, default=512)
  p.add_argument("--rope", type=int, default=64)
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--interpret", action="store_true", help="the kernel in interpret mode")
  p.add_argument("--output", default="")
  a = p.parse_args()
  args = _inputs(a)
  latent_bytes = a.batch * a.context * (a.latent + a.rope) * jnp.dtype(a.dtype).itemsize
  ref = None
  lines = []
  for impl in a.impls.split(","):
    fn = _fn(impl, a)
    out = jax.block_until_ready(fn(*args))
    if ref is None:
      ref = np.asarray(out, np.float32)
    err = float(np.max(np.abs(np.asarray(out, np.float32) - ref)))
    times = []
    for _ in range(a.reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    line = dict(impl=impl, ms=round(ms, 4), gbps=round(latent_bytes / ms / 1e6, 1),
                max_abs_diff_vs_first=err, device=str(jax.devices()[0]), **vars(a))
    lines.append(line)
    print(f"{impl:7s} {ms:9.3f} ms  {line['gbps']:8.1f} GB/s  max|diff| {err:.2e}", flush=True)
  if a.output:
    with open(a.output, "w") as f:
      json.dump(lines, f, indent=1)


if __name__ == "__main__":
  main()
