"""A decode step's layers in one native call (native_decode.py, kernels_cpu/decoder.cc)
against the same layers op by op (causal_lm.run_layers with the decode attention callback).

The op-by-op path is the reference: the hidden states and the written K/V must
match up to float32 summation order, for every weight format the kernel reads
(mixed in one model), float32 and bfloat16 pools, 8- and 16-bit activations, padding
rows, a sliding window and a context over several pages. The fused call must
leave every pool entry it does not own untouched, refuse page ids outside the
pool, and be chosen exactly where it fits. A verify step (speculative decoding:
S positions per sequence, causal among them) runs as B * S decode rows and
matches the op-by-op verify attention; so does a prefill step (its packed chunks as rows
with their chunk's table, `prefill_rows`) against the op-by-op prefill. Through `LLM`,
greedy tokens are the same with it on and off, with and without ngram speculation, and nothing
compiles after warm-up. The AVX2 stack (forced with `XLASERVE_NATIVE_ISA=avx2`)
must match the op-by-op path too, keep a row's bits in any batch with integer
activations (with and without AVX-VNNI), and an engine on it give the XLA path's tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_cpu
from checkpoints import quantizers
from kernels_cpu import decoder
from serving.config import EngineConfig
from serving.models import causal_lm, quantized
from serving.models.model_config import LongRopeScaling, ModelConfig
from serving.runner import native_decode, steps
from serving.runner.inputs import build_prefill_input
from serving.runner.kv_cache import KVCache, create_kv_cache
from serving.types import PrefillChunk, SamplingParams, Sequence

needs_native = pytest.mark.skipif(not kernels_cpu.available(),
                                  reason="native kernels not built or CPU lacks AVX-512")

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                  rope_theta=10000.0)
PAGES, PAGE_SIZE, WIDTH = 12, 4, 4

# A format per linear weight, varied across layers: Q4_1, Q4_0, our uint8 int8, Q8_0.
FORMATS = [lambda w: quantizers.quantize_int4(w, 32),
           lambda w: quantizers.quantize_int4(w, 32, asymmetric=False),
           lambda w: quantizers.quantize_int8(w, 32),
           lambda w: quantizers.quantize_int8(w, 32, asymmetric=False)]
SHAPES = {"wq": (128, 128), "wk": (128, 64), "wv": (128, 64), "wo": (128, 128),
          "w_gate": (128, 256), "w_up": (128, 256), "w_down": (256, 128)}


def _layers(cfg=CFG, seed=0, activation_bits=32):
  rng = np.random.default_rng(seed)
  layers = []
  for i in range(cfg.num_layers):
    lp = {}
    for j, (name, shape) in enumerate(SHAPES.items()):
      w = (rng.standard_normal(shape) * 0.08).astype(np.float32)
      qw = FORMATS[(i + j) % len(FORMATS)](w)
      lp[name] = jax.tree.map(jnp.asarray, qw)
    if activation_bits != 32:  # nibbles and Q8_0 (our uint8 groups keep float activations)
      lp = quantized.with_activation_bits(lp, activation_bits)
    lp["attn_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32)
    lp["mlp_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32)
    layers.append(lp)
  return layers


def _pool(dtype, seed=1) -> KVCache:
  """A pool filled with random keys and values (the context already cached)."""
  kv = create_kv_cache(CFG, PAGES, PAGE_SIZE, dtype)
  rng = np.random.default_rng(seed)
  fill = lambda a: jnp.asarray(  # noqa: E731
      rng.standard_normal(a.shape).astype(np.float32)).astype(
          jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
  if dtype == "bfloat16":
    k, v = (jax.lax.bitcast_convert_type(fill(a), jnp.uint16) for a in (kv.k, kv.v))
  else:
    k, v = fill(kv.k), fill(kv.v)
  return dataclasses.replace(kv, k=k, v=v)


def _step(rows):
  """Decode metadata for `rows` = [(position, pages)]; a None row is padding."""
  positions, kv_index, tables, seq_lens = [], [], [], []
  for row in rows:
    if row is None:
      positions.append(0)
      kv_index.append(0)
      tables.append([0] * WIDTH)
      seq_lens.append(0)
      continue
    pos, pages = row
    positions.append(pos)
    kv_index.append(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
    tables.append(pages + [0] * (WIDTH - len(pages)))
    seq_lens.append(pos + 1)
  meta = dict(kv_index=jnp.asarray(kv_index, jnp.int32),
              block_tables=jnp.asarray(tables, jnp.int32),
              seq_lens=jnp.asarray(seq_lens, jnp.int32))
  return jnp.asarray(positions, jnp.int32), meta


def _op_by_op(layers, cfg, x, positions, meta, kv):
  attend = steps.attend_fn("xla", cfg, "decode", meta, 128)
  return causal_lm.run_layers(layers, cfg, x, positions, kv, attend)


ROWS = [(6, [3, 5]), None, (13, [1, 2, 7, 9]), (0, [4])]


def _assert_pools_match(got_kv, want_kv, kv_dtype, activation_bits, rtol=None):
  """Every pool entry past the dummy page as the reference wrote it (bfloat16 pools: one
  ulp, 2^-7 relative, where an input differs in its last bits, and near zero 5e-4
  absolute: a later layer's K/V inherits an earlier flip's ~1e-4 absolute change, which
  is large relative to a value near zero; `rtol` overrides)."""
  for got, want in ((got_kv.k, want_kv.k), (got_kv.v, want_kv.v)):
    got, want = np.asarray(got), np.asarray(want)
    if kv_dtype == "bfloat16":
      got, want = (np.asarray(jax.lax.bitcast_convert_type(a, jnp.bfloat16), np.float32)
                   for a in (got, want))
    per_layer = got.reshape(CFG.num_layers, PAGES, *got.shape[1:])
    ref_layer = want.reshape(CFG.num_layers, PAGES, *want.shape[1:])
    if rtol is None:
      rtol = 8e-3 if kv_dtype == "bfloat16" else 5e-3 if activation_bits != 32 else 2e-5
    atol = 5e-4 if kv_dtype == "bfloat16" else 1e-4
    np.testing.assert_allclose(per_layer[:, 1:], ref_layer[:, 1:], rtol=rtol, atol=atol)


@needs_native
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation_bits", [32, 16, 8])
@pytest.mark.parametrize("rows", [ROWS[:1], ROWS])
def test_matches_op_by_op(kv_dtype, activation_bits, rows):
  layers = _layers(activation_bits=activation_bits)
  positions, meta = _step(rows)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((len(rows), 128)), jnp.float32)
  kv = _pool(kv_dtype)
  assert native_decode.runs_native(layers, CFG, kv, x, None)
  want_h, want_kv = jax.jit(_op_by_op, static_argnums=1)(layers, CFG, x, positions, meta, kv)
  got_h, got_kv = jax.jit(native_decode.run_layers, static_argnums=1)(layers, CFG, x,
                                                                      positions, meta, kv)
  real = np.array([r is not None for r in rows])
  # Integer activations: a rounding of a code may differ with the summation order. bfloat16
  # pools: a K/V value whose float32 bits differ between the paths (RMSNorm, RoPE and the
  # sums run in C++ here, in XLA there) may round to the neighbouring bfloat16 (2^-8
  # relative), which the next layers' attention carries into h (~1e-4).
  bf16 = kv_dtype == "bfloat16"
  tol = {32: 5e-4 if bf16 else 2e-5, 16: 5e-4 if bf16 else 1e-4, 8: 2e-3}[activation_bits]
  np.testing.assert_allclose(np.asarray(got_h)[real], np.asarray(want_h)[real], rtol=tol,
                             atol=tol)
  # Every pool entry: the rows' new K/V (and the dummy page's padding write) as the
  # reference wrote them, everything else untouched.
  _assert_pools_match(got_kv, want_kv, kv_dtype, activation_bits)


@needs_native
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_rows_through_amx_tiles_give_the_same_bits_without(activation_bits, monkeypatch):
  """20 rows: the integer tiles take 16 of them through AMX where the CPU has it
  (kernels_cpu/quant_int.h), the rest through VNNI; forcing AMX off must give the same
  bits (one block-exact numerics), and the values stay near the op-by-op path's."""
  if not kernels_cpu.library.vnni():
    pytest.skip("integer activations need VNNI")
  layers = _layers(activation_bits=activation_bits)
  rows = [(p, [page]) for page in range(1, 6) for p in range(4)]  # 20 distinct slots
  positions, meta = _step(rows)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((len(rows), 128)), jnp.float32)
  assert native_decode.runs_native(layers, CFG, _pool("float32"), x, None)
  run = jax.jit(native_decode.run_layers, static_argnums=1)
  got_h, got_kv = run(layers, CFG, x, positions, meta, _pool("float32"))
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  off_h, off_kv = run(layers, CFG, x, positions, meta, _pool("float32"))
  assert np.array_equal(np.asarray(got_h), np.asarray(off_h))
  assert np.array_equal(np.asarray(got_kv.k), np.asarray(off_kv.k))
  assert np.array_equal(np.asarray(got_kv.v), np.asarray(off_kv.v))
  want_h, _ = jax.jit(_op_by_op, static_argnums=1)(layers, CFG, x, positions, meta,
                                                   _pool("float32"))
  # Over 20 rows and 3 layers some activations round to the other integer than on the
  # op-by-op path (float sums in a different order), as before the block-exact tiles
  # (the per-lane tiles measured 2.3e-4 / 2.2e-2 here): a bound against wrong values.
  tol = {16: 1e-3, 8: 5e-2}[activation_bits]
  np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=tol, atol=tol)


@needs_native
def test_eight_bit_weights_beside_sixteen_bit_ones_in_one_phase(monkeypatch):
  """A phase whose weights round their input to 8 and 16 bits (Q/K/V, gate/up) rounds it
  once to 16; the 8-bit tiles read its high bytes. Through AMX (20 rows) they must give
  the bits they give with AMX off, and the op-by-op values."""
  if not kernels_cpu.library.vnni():
    pytest.skip("integer activations need VNNI")
  layers = []
  for lp in _layers(activation_bits=16):
    eight = quantized.with_activation_bits({k: lp[k] for k in ("wk", "w_up")}, 8)
    layers.append({**lp, **eight})
  rows = [(p, [page]) for page in range(1, 6) for p in range(4)]
  positions, meta = _step(rows)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((len(rows), 128)), jnp.float32)
  run = jax.jit(native_decode.run_layers, static_argnums=1)
  got_h, _ = run(layers, CFG, x, positions, meta, _pool("float32"))
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  off_h, _ = run(layers, CFG, x, positions, meta, _pool("float32"))
  assert np.array_equal(np.asarray(got_h), np.asarray(off_h))
  want_h, _ = jax.jit(_op_by_op, static_argnums=1)(layers, CFG, x, positions, meta,
                                                   _pool("float32"))
  np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=5e-2, atol=5e-2)


# GGUF K-quants (I a multiple of 256): Q4_K / Q6_K as in a Q4_K_M file, Q5_K, and Q8_0.
K_CFG = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512, num_layers=2,
                            head_dim=64)
K_SHAPES = {"wq": (256, 256), "wk": (256, 128), "wv": (256, 128), "wo": (256, 256),
            "w_gate": (256, 512), "w_up": (256, 512), "w_down": (512, 256)}


def _kquant_layers(activation_bits):
  from kquant_testutil import Q, random_weight

  rng = np.random.default_rng(7)
  types = [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_K, Q.Q8_0]
  layers = []
  for i in range(K_CFG.num_layers):
    lp = {name: jax.tree.map(jnp.asarray, random_weight(
        rng, types[(i + j) % len(types)], shape[1], shape[0], scale=0.1))
        for j, (name, shape) in enumerate(K_SHAPES.items())}
    if activation_bits != 32:  # by hand: `with_activation_bits` keeps K-quants on floats
      lp = {name: dataclasses.replace(w, activation_bits=activation_bits)
            for name, w in lp.items()}
    lp["attn_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(256), jnp.float32)
    lp["mlp_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(256), jnp.float32)
    layers.append(lp)
  return layers


@needs_native
@pytest.mark.parametrize("family,activation_bits,many", [
    ("legacy", 16, False), ("legacy", 8, True), ("kquants", 16, True), ("kquants", 8, False)])
def test_tiled_weights_give_the_bits_of_the_stored_rows(family, activation_bits, many):
  """The layers' Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights in the column-tiled layout
  (`tile_for_native`; our uint8 groups and Q5_K stay as stored) give the fused
  call's h and K/V bitwise, and so does the op-by-op path (per-op matvec on the tiles)."""
  if not kernels_cpu.matvec.tiles():
    pytest.skip("the column-tiled layout needs AVX-512 VNNI")
  if family == "legacy":
    cfg, layers = CFG, _layers(activation_bits=activation_bits)
  else:
    cfg, layers = K_CFG, _kquant_layers(activation_bits)
  tiled = quantized.tile_for_native(layers)
  kinds = {(quantized.kquant_format(w), w.kind, w.offset is None, w.layout)
           for lp in tiled for w in lp.values() if quantized.is_quantized(w)}
  want_kinds = ({(None, "int4", False, "tiles"), (None, "int4", True, "tiles"),
                 (None, "int8", False, "rows"), (None, "int8", True, "tiles")}
                if family == "legacy" else
                {("q4_k", "int4", False, "tiles"), ("q5_k", "int5", False, "rows"),
                 ("q6_k", "int6", True, "tiles"), (None, "int8", True, "tiles")})
  assert kinds == want_kinds
  rows = MANY_ROWS if many else ROWS
  positions, meta = _step(rows)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((len(rows), cfg.hidden_size)),
                  jnp.float32)
  kv = create_kv_cache(cfg, PAGES, PAGE_SIZE, "float32")
  assert native_decode.runs_native(tiled, cfg, kv, x, None)
  for fn in (native_decode.run_layers, _op_by_op):
    run = jax.jit(fn, static_argnums=1)
    want_h, want_kv = run(layers, cfg, x, positions, meta, kv)
    got_h, got_kv = run(tiled, cfg, x, positions, meta, kv)
    assert np.array_equal(np.asarray(got_h), np.asarray(want_h))
    assert np.array_equal(np.asarray(got_kv.k), np.asarray(want_kv.k))
    assert np.array_equal(np.asarray(got_kv.v), np.asarray(want_kv.v))


# 20 rows (more than one tile of 8 rows, and past 13, where the kernel checks stopped):
# positions 0-3 on each of pages 1-5, all written in the step.
MANY_ROWS = [(b % PAGE_SIZE, [1 + b // PAGE_SIZE]) for b in range(20)]


@needs_native
@pytest.mark.parametrize("activation_bits", [32, 16, 8])
@pytest.mark.parametrize("many", [False, True], ids=["2rows", "20rows"])
def test_kquants_match_op_by_op(activation_bits, many):
  """Q4_K, Q5_K, Q6_K (and Q8_0) weights as stored, on the float or the integer tiles:
  the fused call gives the op-by-op path's hidden states and K/V."""
  if activation_bits != 32 and not kernels_cpu.library.vnni():
    pytest.skip("no VNNI")
  layers = _kquant_layers(activation_bits)
  assert {quantized.kquant_format(lp[n]) for lp in layers for n in K_SHAPES} == {
      "q4_k", "q5_k", "q6_k", None}
  assert {lp[n].native_activation_bits(1) for lp in layers for n in K_SHAPES} == {
      activation_bits}
  rows = MANY_ROWS if many else [ROWS[0], ROWS[2]]
  positions, meta = _step(rows)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((len(rows), 256)), jnp.float32)
  kv = create_kv_cache(K_CFG, PAGES, PAGE_SIZE, "float32")
  fill = np.random.default_rng(1)
  kv = dataclasses.replace(kv, k=jnp.asarray(fill.standard_normal(kv.k.shape), jnp.float32),
                           v=jnp.asarray(fill.standard_normal(kv.v.shape), jnp.float32))
  assert native_decode.runs_native(layers, K_CFG, kv, x, None)
  want_h, want_kv = jax.jit(_op_by_op, static_argnums=1)(layers, K_CFG, x, positions, meta, kv)
  got_h, got_kv = jax.jit(native_decode.run_layers, static_argnums=1)(layers, K_CFG, x,
                                                                      positions, meta, kv)
  # Integer tiles: the two paths' float sums differ in order, so an activation close to a
  # rounding boundary may round one step apart (2^-16 or 2^-8 of its group's largest),
  # and the step grows through the later projections and the second layer.
  tol = {32: 2e-5, 16: 5e-4, 8: 2e-3}[activation_bits]
  np.testing.assert_allclose(np.asarray(got_h), np.asarray(want_h), rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(got_kv.k), np.asarray(want_kv.k),
                             rtol=5e-3 if activation_bits != 32 else 2e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("layer_types", [(), ("sliding_attention",) * 3,
                                         ("full_attention",) * 3])
def test_sliding_window_matches(layer_types):
  """One window for every layer (`sliding_window`, or per-layer types all alike; all
  full-attention layers ignore `sliding_window`)."""
  cfg = dataclasses.replace(CFG, sliding_window=5, layer_types=layer_types)
  layers = _layers(cfg)
  positions, meta = _step([ROWS[2], ROWS[0]])
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 128)), jnp.float32)
  kv = _pool("float32")
  want, _ = jax.jit(_op_by_op, static_argnums=1)(layers, cfg, x, positions, meta, kv)
  got, _ = jax.jit(native_decode.run_layers, static_argnums=1)(layers, cfg, x, positions, meta,
                                                               kv)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _verify(seqs, s):
  """Verify metadata for `seqs` = [(position, pages, num_drafts)] of S = s positions each
  (as steps.verify_step builds it); a None sequence is padding."""
  positions, kv_index, tables, q_lens = [], [], [], []
  for seq in seqs:
    pos, pages, drafts = seq if seq is not None else (0, [0], -1)
    for j in range(s):
      used = j <= drafts
      p = pos + j
      positions.append(p)
      kv_index.append(pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE if used else 0)
      q_lens.append(p + 1 if used else 0)
    tables.append(pages + [0] * (WIDTH - len(pages)))
  meta = dict(kv_index=jnp.asarray(kv_index, jnp.int32),
              block_tables=jnp.asarray(tables, jnp.int32),
              q_lens=jnp.asarray(q_lens, jnp.int32).reshape(len(seqs), s))
  used = np.asarray(q_lens) > 0
  return jnp.asarray(positions, jnp.int32), meta, used


def _op_by_op_verify(layers, cfg, x, positions, meta, kv):
  attend = steps.attend_fn("xla", cfg, "verify", meta, 128)
  return causal_lm.run_layers(layers, cfg, x, positions, kv, attend)


# (position of the latest token, pages, drafts): all drafts, fewer drafts across a page
# boundary, none; and padding.
VERIFY = [(5, [3, 5, 6, 10], 4), (10, [1, 2, 7, 9], 2), None, (0, [4, 8], 0)]


@needs_native
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation_bits", [32, 16])
@pytest.mark.parametrize("s", [5, 10])  # 20 rows; 40, past the per-op matvec's 32
def test_verify_rows_match_op_by_op_verify(kv_dtype, activation_bits, s):
  """A verify step's S positions per sequence as decode rows (`verify_rows`): each
  position sees the keys of the positions before it written in the same call. (8-bit
  activations: one rounding flip from the RMSNorm's summation order moves a K/V value by
  ~1% of its group, and every later position of the sequence sees it; the decode test
  above covers that format.)"""
  layers = _layers(activation_bits=activation_bits)
  positions, meta, used = _verify(VERIFY, s)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((len(VERIFY) * s, 128)),
                  jnp.float32)
  kv = _pool(kv_dtype)
  assert native_decode.runs_native(layers, CFG, kv, x, None)
  want_h, want_kv = jax.jit(_op_by_op_verify, static_argnums=1)(layers, CFG, x, positions,
                                                                meta, kv)
  run = lambda *a: native_decode.run_layers(  # noqa: E731
      a[0], CFG, a[1], a[2], native_decode.verify_rows(a[3]), a[4])
  got_h, got_kv = jax.jit(run)(layers, x, positions, meta, kv)
  # 16 bits: roundings feed later positions. A bfloat16 pool: a K/V value whose float32
  # differs in its last bits (the projections' summation order, which differs between
  # CPUs) can round to the neighbouring bfloat16 (2^-8 relative), and every later
  # position attending to it moves by ~1e-4.
  tol = {32: 2e-5, 16: 5e-4}[activation_bits]
  if kv_dtype == "bfloat16":
    tol = max(tol, 1e-3)
  np.testing.assert_allclose(np.asarray(got_h)[used], np.asarray(want_h)[used], rtol=tol,
                             atol=tol)
  _assert_pools_match(got_kv, want_kv, kv_dtype, activation_bits)


@needs_native
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_verify_positions_attending_together_give_the_bits_of_each_alone(kv_dtype):
  """A sequence's verify positions, next to each other, read its keys once for all of
  them (decoder.cc `AttentionSpans`, attention.h `AttendQueries`); interleaved with the
  other sequences' rows (no two neighbours share a table) each attends alone
  (`AttendQuery`). Every row's hidden state has the same bits either way, and so has
  the pool but for page 0 (where the padding rows write, in row order)."""
  layers = _layers()
  s = 10
  positions, meta, used = _verify(VERIFY, s)
  rows = native_decode.verify_rows(meta)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((len(VERIFY) * s, 128)),
                  jnp.float32)
  order = np.arange(len(VERIFY) * s).reshape(len(VERIFY), s).T.reshape(-1)  # position-major
  run = jax.jit(native_decode.run_layers, static_argnums=1)
  together_h, together_kv = run(layers, CFG, x, positions, rows, _pool(kv_dtype))
  alone_h, alone_kv = run(layers, CFG, x[order], positions[order],
                          {k: v[order] for k, v in rows.items()}, _pool(kv_dtype))
  np.testing.assert_array_equal(np.asarray(together_h)[order][used[order]],
                                np.asarray(alone_h)[used[order]])
  written = np.arange(together_kv.k.shape[0]) % PAGES != 0
  for a, b in ((together_kv.k, alone_kv.k), (together_kv.v, alone_kv.v)):
    np.testing.assert_array_equal(np.asarray(a)[written], np.asarray(b)[written])


# Prefill chunks as (cached tokens before the chunk, chunk tokens, pages): one continuing a
# context over four pages, one from position 0, one single token; padding after them.
PREFILL_CHUNKS = [(6, 9, [3, 5, 8, 9]), (0, 7, [1, 2]), (0, 1, [4])]


@needs_native
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation_bits", [32, 16])
def test_prefill_rows_match_op_by_op_prefill(kv_dtype, activation_bits):
  config = EngineConfig.of(page_size=PAGE_SIZE, max_model_len=WIDTH * PAGE_SIZE,
                           max_num_batched_tokens=64, max_num_seqs=4, attention_block_tokens=8)
  chunks = []
  for i, (cached, n, pages) in enumerate(PREFILL_CHUNKS):
    seq = Sequence(request_id=str(i), prompt_ids=list(range(cached + n)),
                   params=SamplingParams(), pages=pages, decode_slot=i)
    chunks.append(PrefillChunk(seq, cached, cached + n, sample=True))
  inp, _ = build_prefill_input(chunks, config, bucket=64)  # 64 rows: room for 4 chunks
  meta = jax.tree.map(jnp.asarray, steps.prefill_meta(inp))
  positions = jnp.asarray(inp.positions)
  total = int(inp.cu_q_lens[-1])
  assert inp.tokens.shape[0] > total  # padding rows after the chunks
  layers = _layers(activation_bits=activation_bits)
  x = jnp.asarray(np.random.default_rng(4).standard_normal((inp.tokens.shape[0], 128)),
                  jnp.float32)
  kv = _pool(kv_dtype)
  assert native_decode.runs_native(layers, CFG, kv, x, None)

  def op_by_op(layers, x, positions, meta, kv):
    attend = steps.attend_fn("xla", CFG, "prefill", meta, 8)
    return causal_lm.run_layers(layers, CFG, x, positions, kv, attend)

  def fused(layers, x, positions, meta, kv):
    return native_decode.run_layers(layers, CFG, x, positions,
                                    native_decode.prefill_rows(meta, positions), kv)

  want_h, want_kv = jax.jit(op_by_op)(layers, x, positions, meta, kv)
  assert "xlaserve_decode_layers" in str(jax.make_jaxpr(fused)(layers, x, positions, meta, kv))
  got_h, got_kv = jax.jit(fused)(layers, x, positions, meta, kv)
  # As test_matches_op_by_op, over 17 rows instead of 3: more values whose last bits
  # differ between the paths and round to a neighbouring integer (16-bit activations) or
  # bfloat16 (the pools) before the later layers carry them.
  bf16 = kv_dtype == "bfloat16"
  tol = {32: 5e-4 if bf16 else 2e-5, 16: 2e-3 if bf16 else 5e-4}[activation_bits]
  np.testing.assert_allclose(np.asarray(got_h)[:total], np.asarray(want_h)[:total], rtol=tol,
                             atol=tol)
  _assert_pools_match(got_kv, want_kv, kv_dtype, activation_bits,  # bfloat16: two ulps
                      rtol=2e-2 if bf16 and activation_bits == 16 else None)


@needs_native
def test_verify_of_k8_at_batch_4_takes_the_fused_call():
  """36 rows (4 sequences of 9 positions) are within the fused call's rows; past its own
  limit the step runs op by op."""
  layers = _layers()
  kv = _pool("float32")
  assert native_decode.runs_native(layers, CFG, kv, jnp.ones((36, 128)), None)
  limit = kernels_cpu.decoder.MAX_ROWS
  assert native_decode.runs_native(layers, CFG, kv, jnp.ones((limit, 128)), None)
  assert not native_decode.runs_native(layers, CFG, kv, jnp.ones((limit + 1, 128)), None)


@needs_native
def test_donated_pool_is_updated_in_place():
  """Inside a step that donates the pool the call aliases it: no copy of the pool in the
  compiled program."""
  layers = _layers()
  positions, meta = _step(ROWS[:1])
  x = jnp.ones((1, 128), jnp.float32)
  kv = _pool("float32")
  fn = jax.jit(native_decode.run_layers, static_argnums=1, donate_argnums=5)
  hlo = fn.lower(layers, CFG, x, positions, meta, kv).compile().as_text()
  pool_shape = "f32[" + ",".join(str(d) for d in kv.k.shape) + "]"
  copies = [line for line in hlo.splitlines() if " copy(" in line and pool_shape in line]
  assert not copies, copies


@needs_native
def test_page_outside_the_pool_is_refused():
  layers = _layers()
  positions, meta = _step(ROWS[:1])
  meta["block_tables"] = meta["block_tables"].at[0, 1].set(PAGES)
  with pytest.raises(Exception, match="page id outside the pool"):
    jax.block_until_ready(native_decode.run_layers(layers, CFG, jnp.ones((1, 128)), positions,
                                                   meta, _pool("float32")))


@needs_native
def test_chosen_only_where_it_fits(monkeypatch):
  layers = _layers()
  x = jnp.ones((2, 128), jnp.float32)
  kv = _pool("float32")
  assert native_decode.runs_native(layers, CFG, kv, x, None)
  assert not native_decode.runs_native(layers, CFG, kv, x, lora=object())
  assert not native_decode.runs_native(layers, CFG, _pool_int8(), x, None)
  assert not native_decode.runs_native(layers, dataclasses.replace(CFG, qkv_bias=True), kv, x,
                                       None)
  assert not native_decode.runs_native(layers, dataclasses.replace(CFG, qk_norm=True), kv, x,
                                       None)
  for change in (dict(attention_sinks=True), dict(attn_soft_cap=50.0), dict(attn_scale=0.1),
                 dict(family="gemma3"),
                 dict(sliding_window=4, layer_types=("sliding_attention", "full_attention",
                                                     "sliding_attention"))):
    assert not native_decode.runs_native(layers, dataclasses.replace(CFG, **change), kv, x,
                                         None), change
  one_window = dataclasses.replace(CFG, sliding_window=4, layer_types=("sliding_attention",) * 3)
  assert native_decode.runs_native(layers, one_window, kv, x, None)
  assert not native_decode.runs_native(layers, CFG, kv, x.astype(jnp.bfloat16), None)
  # The decoder's own row limit, not the matvec's (which takes prefill chunks).
  assert native_decode.runs_native(layers, CFG, kv, jnp.ones((decoder.MAX_ROWS, 128)), None)
  assert not native_decode.runs_native(layers, CFG, kv, jnp.ones((decoder.MAX_ROWS + 1, 128)),
                                       None)
  # Phi-3's layer is the kernel's, but not its RoPE on part of each head or LongRoPE's
  # scaled cos / sin.
  phi3 = dataclasses.replace(CFG, family="phi3", model_type="phi3")
  assert native_decode.runs_native(layers, phi3, kv, x, None)
  assert not native_decode.runs_native(
      layers, dataclasses.replace(phi3, partial_rotary_factor=0.75), kv, x, None)
  longrope = LongRopeScaling(short_factor=(1.0,) * 16, long_factor=(2.0,) * 16,
                             original_max_position_embeddings=64, attention_factor=1.2,
                             use_long=False)
  assert not native_decode.runs_native(
      layers, dataclasses.replace(phi3, rope_scaling=longrope), kv, x, None)
  float_wq = [{**lp, "wq": jnp.zeros((128, 128))} for lp in layers]
  assert not native_decode.runs_native(float_wq, CFG, kv, x, None)
  # Beside a dense copy, batches over 8 rows multiply the copy: op by op.
  copied = [{**lp, "wq": dataclasses.replace(lp["wq"], full=jnp.zeros((128, 128)))}
            for lp in layers]
  assert native_decode.runs_native(copied, CFG, kv, jnp.ones((8, 128)), None)
  assert not native_decode.runs_native(copied, CFG, kv, jnp.ones((9, 128)), None)
  monkeypatch.setenv("XLASERVE_NATIVE_LAYERS", "0")
  assert not native_decode.runs_native(layers, CFG, kv, x, None)


def _pool_int8():
  return create_kv_cache(CFG, PAGES, PAGE_SIZE, "int8")


@needs_native
@pytest.mark.parametrize("family", ["smollm2", "phi3_mini"])
def test_llm_greedy_tokens_same_with_and_without(family, monkeypatch, tmp_path):
  """Tiny SmolLM2-shaped model and Phi-3-mini-shaped one (a 16-token window), int8 groups
  of 32: the engine's decode steps take the fused call, and give the op-by-op path's
  greedy tokens."""
  tiny_models = pytest.importorskip("tiny_models")
  from serving import LLM, SamplingParams

  path = str(tmp_path / family)
  tiny_models.save_tiny_model(family, path)
  engine = dict(max_num_seqs=4, max_model_len=128, num_pages=32, max_num_batched_tokens=32,
                dtype="float32", quantization="int8", compilation_cache=False)
  greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  prompts = ["hello world", "the quick brown fox jumps", "a"]
  fused = LLM(path, **engine)
  layers = fused.engine.runner.params["layers"]
  x = jnp.ones((1, fused.engine.runner.model_cfg.hidden_size), jnp.float32)
  assert native_decode.runs_native(layers, fused.engine.runner.model_cfg,
                                   fused.engine.runner.state.kv, x, None)
  got = [o.token_ids for o in fused.generate(prompts, greedy)]
  monkeypatch.setenv("XLASERVE_NATIVE_LAYERS", "0")
  want = [o.token_ids for o in LLM(path, **engine).generate(prompts, greedy)]
  assert got == want


@needs_native
@pytest.mark.slow
def test_default_model_same_tokens_and_logprobs_with_tiles_and_stored_rows():
  """The default model (Q4_0 layers, a Q8_0 embedding and tied head) is served from the
  column-tiled layout by default; with `cpu_weight_tiles=False` from the stored rows: the
  same greedy tokens and logprobs, bitwise, alone (fused decode, batch 1) and among 20
  (prefill and decode rows past one row tile)."""
  if not kernels_cpu.matvec.tiles():
    pytest.skip("the engine tiles weights on AVX-512 VNNI")
  from serving import LLM, SamplingParams

  greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
  prompts = [f"Question {i}: what is {i} plus {i * 3}? Answer briefly." for i in range(20)]
  results = {}
  for tiles in (True, False):
    llm = LLM("smollm2-135m-instruct", max_num_seqs=32, cpu_weight_tiles=tiles)
    layouts = {w.layout for w in jax.tree.leaves(llm.engine.runner.params,
                                                  is_leaf=quantized.is_quantized)
               if quantized.is_quantized(w)}
    assert layouts == ({"tiles"} if tiles else {"rows"})
    outs = llm.generate(prompts[:1], greedy) + llm.generate(prompts, greedy)
    results[tiles] = [(o.token_ids, [(lp.token_id, lp.logprob, lp.top)
                                     for lp in o.logprobs]) for o in outs]
    del llm
  assert results[True] == results[False]


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation_bits", [32, 16, 8])
def test_avx2_matches_op_by_op(force_avx2, kv_dtype, activation_bits):
  """The AVX2 stack (float and integer tiles): every weight format, padding rows, several
  pages."""
  layers = _layers(activation_bits=activation_bits)
  positions, meta = _step(ROWS)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((len(ROWS), 128)), jnp.float32)
  kv = _pool(kv_dtype)
  assert native_decode.runs_native(layers, CFG, kv, x, None)
  fused = jax.jit(native_decode.run_layers, static_argnums=1)
  assert "xlaserve_decode_layers_avx2" in str(jax.make_jaxpr(
      native_decode.run_layers, static_argnums=1)(layers, CFG, x, positions, meta, kv))
  want_h, want_kv = jax.jit(_op_by_op, static_argnums=1)(layers, CFG, x, positions, meta, kv)
  got_h, got_kv = fused(layers, CFG, x, positions, meta, kv)
  real = np.array([r is not None for r in ROWS])
  # bfloat16 pools: a K/V value whose last float32 bits differ may round to another
  # bfloat16, and the layers after it see that; integer activations: a code's rounding.
  tol = {32: 2e-5 if kv_dtype == "float32" else 2e-4,
         16: 1e-4 if kv_dtype == "float32" else 5e-4, 8: 2e-3}[activation_bits]
  np.testing.assert_allclose(np.asarray(got_h)[real], np.asarray(want_h)[real], rtol=tol,
                             atol=tol)
  _assert_pools_match(got_kv, want_kv, kv_dtype, activation_bits)


@pytest.mark.parametrize("activation_bits", [16, 8])
def test_avx2_row_alone_gives_its_bits_among_rows(force_avx2, activation_bits, monkeypatch):
  """The AVX2 stack's integer tiles (quant_dot_avx2.h: block-exact, 8 columns x up to 4
  rows) give a row the same bits alone as among 9 rows (full and partial row tiles),
  with AVX-VNNI where the CPU has it and with it off (`XLASERVE_NATIVE_AVXVNNI=0`)."""
  layers = _layers(activation_bits=activation_bits)
  rows = [(p % 4, [page]) for page, p in enumerate([0, 1, 2, 3, 0, 1, 2, 3, 2], start=1)]
  positions, meta = _step(rows)  # distinct pages: no row reads another's keys
  x = jnp.asarray(np.random.default_rng(4).standard_normal((len(rows), 128)), jnp.float32)
  run = jax.jit(native_decode.run_layers, static_argnums=1)
  assert "xlaserve_decode_layers_avx2" in str(jax.make_jaxpr(
      native_decode.run_layers, static_argnums=1)(layers, CFG, x, positions, meta,
                                                  _pool("float32")))
  together = np.asarray(run(layers, CFG, x, positions, meta, _pool("float32"))[0])
  for at in (0, 4, 8):
    one_pos, one_meta = _step([rows[at]])
    alone = run(layers, CFG, x[at:at + 1], one_pos, one_meta, _pool("float32"))[0]
    assert np.array_equal(np.asarray(alone)[0], together[at]), at
  monkeypatch.setenv("XLASERVE_NATIVE_AVXVNNI", "0")
  off = np.asarray(run(layers, CFG, x, positions, meta, _pool("float32"))[0])
  assert np.array_equal(off, together)


@pytest.mark.slow
def test_avx2_llm_greedy_tokens_same_as_xla_path(force_avx2, monkeypatch, tmp_path):
  """A tiny SmolLM2-shaped model, int8 groups of 32, served with the AVX2 kernels forced
  (matvec and attention at prefill, the fused stack at decode) gives the greedy tokens of
  the XLA path (`XLASERVE_NATIVE=0`)."""
  from kernels_cpu import library

  tiny_models = pytest.importorskip("tiny_models")
  from serving import LLM, SamplingParams

  path = str(tmp_path / "smollm2")
  tiny_models.save_tiny_model("smollm2", path)
  engine = dict(max_num_seqs=4, max_model_len=128, num_pages=32, max_num_batched_tokens=32,
                dtype="float32", quantization="int8", compilation_cache=False)
  greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  prompts = ["hello world", "the quick brown fox jumps", "a"]
  on_avx2 = LLM(path, **engine)
  runner = on_avx2.engine.runner
  x = jnp.ones((1, runner.model_cfg.hidden_size), jnp.float32)
  assert native_decode.runs_native(runner.params["layers"], runner.model_cfg, runner.state.kv,
                                   x, None)
  got = [o.token_ids for o in on_avx2.generate(prompts, greedy)]
  monkeypatch.setenv("XLASERVE_NATIVE", "0")
  library.isa.cache_clear()
  assert not kernels_cpu.available()
  want = [o.token_ids for o in LLM(path, **engine).generate(prompts, greedy)]
  assert got == want


@needs_native
@pytest.mark.slow
def test_llm_speculative_tokens_same_with_and_without(monkeypatch, tmp_path):
  """ngram speculation on a tiny SmolLM2-shaped int8 model: every verify bucket (B
  sequences of k + 1 positions) is traced through the fused call at warm-up, nothing
  compiles after it, and the greedy tokens (drafts kept or not) are the op-by-op path's
  and the plain engine's."""
  tiny_models = pytest.importorskip("tiny_models")
  from compile_watch import compile_events

  from serving import LLM, SamplingParams

  path = str(tmp_path / "smollm2")
  tiny_models.save_tiny_model("smollm2", path)
  k = 4
  engine = dict(max_num_seqs=4, max_model_len=128, num_pages=48, max_num_batched_tokens=32,
                dtype="float32", quantization="int8", compilation_cache=False)
  spec = dict(speculative_method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
              speculative_max_batch=4)
  greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
  # Repetitive prompts: the n-gram proposer finds drafts, and the model keeps some.
  prompts = ["a b c a b c a b c a b", "one two three one two three one", "x y x y x y x"]
  traced: list[int] = []
  run_layers = native_decode.run_layers
  monkeypatch.setattr(native_decode, "run_layers",
                      lambda layers, cfg, x, *a: traced.append(x.shape[0])
                      or run_layers(layers, cfg, x, *a))
  fused = LLM(path, **engine, **spec)
  buckets = fused.engine.config.verify_batch_buckets
  assert {b * (k + 1) for b in buckets} <= set(traced), (buckets, traced)
  with compile_events() as events:
    got = [o.token_ids for o in fused.generate(prompts, greedy)]
  assert events == [], f"compiled after warm-up: {sorted(set(events))}"
  assert fused.engine.stats().spec_decode.num_accepted_tokens > 0
  plain = [o.token_ids for o in LLM(path, **engine).generate(prompts, greedy)]
  monkeypatch.setenv("XLASERVE_NATIVE_LAYERS", "0")
  op_by_op = [o.token_ids for o in LLM(path, **engine, **spec).generate(prompts, greedy)]
  assert got == op_by_op == plain


_ONE_THREAD = """
import sys
sys.path.insert(0, {here!r})
import jax, numpy as np
import test_native_decode as t
from serving.runner import native_decode
layers = t._layers()
positions, meta = t._step(t.ROWS)
x = jax.numpy.asarray(np.random.default_rng(2).standard_normal((len(t.ROWS), 128)), "float32")
h, _ = native_decode.run_layers(layers, t.CFG, x, positions, meta, t._pool("float32"))
np.save({out!r}, np.asarray(h))
"""


@needs_native
def test_one_thread_gives_the_same_values(tmp_path):
  """`XLASERVE_NATIVE_THREADS=1`: no helpers at all (the caller runs every loop alone, as
  when XLA's pool threads never start) gives the values of the threaded call."""
  import os
  import subprocess
  import sys

  from server_procs import subprocess_env

  out = str(tmp_path / "h.npy")
  script = _ONE_THREAD.format(here=os.path.dirname(__file__), out=out)
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                     env=subprocess_env(XLASERVE_NATIVE_THREADS="1"), timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  positions, meta = _step(ROWS)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((len(ROWS), 128)), jnp.float32)
  h, _ = native_decode.run_layers(_layers(), CFG, x, positions, meta, _pool("float32"))
  np.testing.assert_allclose(np.load(out), np.asarray(h), rtol=1e-6, atol=1e-6)
