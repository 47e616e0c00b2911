"""The block-exact integer-activation tiles (kernels_cpu/quant_int.h) against a numpy
reference of their numerics, and their batch invariance with and without AMX.

For each row, column and group of 32 inputs the integer dot product of the codes
(Q8_0 codes, Q4_0 nibbles - 8, Q4_1 nibbles) with the row's rounded activations is
exact (a16: 256 * hi + lo), then one float32 epilogue runs sequentially over the
groups: acc = fma(float(isum), dx * d, acc); Q4_1 adds mins = fma(m, xsum, mins);
y = acc * unit (Q4_1: fma(acc, unit, mins)), unit = 1/256 for a16. The reference
computes the same operations (fused multiply-adds emulated exactly in float64), so
the kernel must match it bitwise, for every row count (VNNI tiles below 16 rows; from
16, AMX tiles where the CPU has them, else the VNNI tiles over packed columns) and with
AMX forced off. The AVX2 set's tiles
(quant_dot_avx2.h, forced with `XLASERVE_NATIVE_ISA=avx2`) take the same numerics, so
they must match the same reference bitwise, with AVX-VNNI (where the CPU has it) and
with the VPMADDWD products (`XLASERVE_NATIVE_AVXVNNI=0`), and keep each row's bits in
any batch.

GGUF K-quants (Q4_K, Q5_K, Q6_K) take the same tiles and numerics: Q4_K / Q5_K as
Q4_1 with d = super-block d x the group's scale code and m = -dmin x its min code
(AMX tiles too); Q6_K per 16 inputs, (code - 32) with d x its int8 scale code, two fmas
a group (AMX only from the column-tiled layout, a product per 16-input half). The
column-tiled layout meets the same reference, AMX included (at 16 rows the B tiles are
unpacked a group at a time, at 37 once for both row tiles).
"""

import ctypes
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kquant_testutil import Q, random_weight

from checkpoints import quantizers
from kernels_cpu import library, matvec
from serving.models import quantized as quant

needs_vnni = pytest.mark.skipif(library.isa() != "avx512" or not library.vnni(),
                                reason="no native kernels, no AVX-512 or no VNNI")
FORMATS = ["q8_0", "q4_0", "q4_1"]


def _fma32(a, b, c):
  """float32 fma(a, b, c), correctly rounded: a * b is exact in float64, the float64 sum
  rounds once more, and a sum that lands exactly halfway between two float32s is moved
  off the tie toward the exact value (the only case where rounding twice differs)."""
  a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
  p = a * b
  s = p + c
  bp = s - c
  err = (p - bp) + (c - (s - bp))  # s + err == p + c exactly (TwoSum)
  tie = (s.view(np.int64) & ((1 << 29) - 1)) == (1 << 28)
  s = np.where(tie & (err != 0), np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
  return s.astype(np.float32)


def _rounded_rows(x: np.ndarray, bits: int):
  """quant_dot.h QuantizeRowRange in float32: hi, lo (int), dx, xsum8, xsum16 per group."""
  g = x.reshape(x.shape[0], -1, 32).astype(np.float32)
  dx = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
  inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
  scaled = (g * inv[..., None]).astype(np.float32)
  hi = np.rint(scaled).astype(np.int64)
  lo = np.zeros_like(hi)
  if bits == 16:
    rest = ((scaled - hi.astype(np.float32)) * np.float32(256)).astype(np.float32)
    lo = np.clip(np.rint(rest), -127, 127).astype(np.int64)
  sum8, sum_lo = hi.sum(-1).astype(np.float32), lo.sum(-1).astype(np.float32)
  xsum8 = (dx * sum8).astype(np.float32)
  xsum16 = (dx * (sum8 + sum_lo * np.float32(1 / 256))).astype(np.float32)
  return hi, lo, dx, xsum8, xsum16


def _signed_codes(fmt: str, q) -> np.ndarray:
  """[O, groups, 32] integer weights: Q8_0 codes, Q4_0 nibbles - 8, Q4_1 nibbles."""
  q = np.asarray(q)
  if fmt == "q8_0":
    return q.astype(np.int64).reshape(q.shape[0], -1, 32)
  b = q.astype(np.int64).reshape(q.shape[0], -1, 16)
  n = np.concatenate([b & 15, b >> 4], -1)
  return n - 8 if fmt == "q4_0" else n


def block_exact_reference(x, fmt, q, scale, offset, bits):
  """The module docstring's numerics for x [B, I] and a weight's codes, scales, mins."""
  hi, lo, dx, xsum8, xsum16 = _rounded_rows(x, bits)
  act = hi * 256 + lo if bits == 16 else hi
  isum = np.einsum("bgi,ogi->bog", act, _signed_codes(fmt, q))
  assert np.abs(isum).max() < 2**31  # the int32 bound the kernels rely on
  isum = isum.astype(np.int32).astype(np.float32)
  d = np.asarray(scale).astype(np.float32)
  acc = np.zeros(isum.shape[:2], np.float32)
  mins = np.zeros_like(acc)
  m = np.asarray(offset).astype(np.float32) if fmt == "q4_1" else None
  xsum = xsum16 if bits == 16 else xsum8
  for g in range(isum.shape[2]):
    acc = _fma32(isum[:, :, g], (dx[:, None, g] * d[None, :, g]).astype(np.float32), acc)
    if m is not None:
      mins = _fma32(np.broadcast_to(m[None, :, g], acc.shape),
                    np.broadcast_to(xsum[:, None, g], acc.shape), mins)
  unit = np.float32(1 / 256 if bits == 16 else 1)
  if m is not None:
    return _fma32(acc, np.full_like(acc, unit), mins)
  return (acc * unit).astype(np.float32)


def _weight(fmt: str, out_dim: int, in_dim: int):
  w = (np.random.default_rng(7).standard_normal((in_dim, out_dim)) * 0.05).astype(np.float32)
  if fmt == "q8_0":
    qw = jax.tree.map(jnp.asarray, quantizers.quantize_int8(w, 32, asymmetric=False))
    return dataclasses.replace(qw, q=qw.q.at[0, :4].set(jnp.int8(-128)))  # the unpaired code
  return jax.tree.map(jnp.asarray, quantizers.quantize_int4(w, 32, asymmetric=fmt == "q4_1"))


def _product(x, qw, bits):
  return np.asarray(matvec.quantized_matvec(jnp.asarray(x), qw.q, qw.scale, qw.offset,
                                            qw.bits, activation_bits=bits))


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 7, 16, 37])  # VNNI; one AMX / packed tile; both
def test_matches_block_exact_reference_bitwise(fmt, bits, rows, monkeypatch):
  """Columns not a multiple of 16 (70), groups not a multiple of 4 (18), an all-zero
  activation group, with AMX (where the CPU has it) and forced off."""
  qw = _weight(fmt, 70, 576)
  x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
  x[0, :32] = 0.0
  want = block_exact_reference(x, fmt, qw.q, qw.scale, qw.offset, bits)
  assert np.array_equal(_product(x, qw, bits), want)
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  assert np.array_equal(_product(x, qw, bits), want)


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bits", [8, 16])
def test_a_row_alone_is_bitwise_the_row_among_300(fmt, bits, monkeypatch):
  """Batch invariance across the VNNI tiles (1 row), the AMX tiles and the VNNI rest of
  a 300-row call (several row blocks), and AMX on vs off."""
  out_dim, in_dim = 1030, 1024
  qw = _weight(fmt, out_dim, in_dim)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((300, in_dim)).astype(np.float32) * rng.uniform(0.1, 10.0, (300, 1))
  together = _product(x, qw, bits)
  for at in (0, 150, 299):
    assert np.array_equal(_product(x[at:at + 1], qw, bits)[0], together[at]), at
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  assert np.array_equal(_product(x, qw, bits), together)


# ---- The column-tiled layout (quant_format.h IntWeight::tiled) ----

def _tiled_product(x, qw, bits):
  q, scale, offset = matvec.tile_columns(qw.q, qw.bits, qw.scale, qw.offset)
  return np.asarray(matvec.quantized_matvec(
      jnp.asarray(x), jnp.asarray(q), jnp.asarray(scale),
      None if offset is None else jnp.asarray(offset), qw.bits, activation_bits=bits,
      tiled=True))


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 7, 16, 37])  # row tiles; one AMX tile; both
def test_tiled_layout_matches_block_exact_reference_bitwise(fmt, bits, rows, monkeypatch):
  """The same reference as the stored rows, from a weight re-laid in 16-column tiles (80
  columns: five tiles; 18 groups; an all-zero activation group), with AMX (B tiles from
  the tiled codes, where the CPU has it) and forced off."""
  qw = _weight(fmt, 80, 576)
  x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
  x[0, :32] = 0.0
  want = block_exact_reference(x, fmt, qw.q, qw.scale, qw.offset, bits)
  assert np.array_equal(_tiled_product(x, qw, bits), want)
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  assert np.array_equal(_tiled_product(x, qw, bits), want)


@needs_vnni
@pytest.mark.parametrize("fmt", FORMATS)
def test_tiled_layout_row_alone_is_bitwise_the_row_among_300(fmt):
  """Batch invariance in the tiled layout, and the same bits as the stored rows."""
  qw = _weight(fmt, 1024, 1024)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((300, 1024)).astype(np.float32) * rng.uniform(0.1, 10.0, (300, 1))
  together = _tiled_product(x, qw, 16)
  assert np.array_equal(together, _product(x, qw, 16))
  for at in (0, 150, 299):
    assert np.array_equal(_tiled_product(x[at:at + 1], qw, 16)[0], together[at]), at


@pytest.mark.parametrize("bits", [4, 8])
def test_tile_columns_round_trips_and_gathers_rows(bits):
  """tile_columns / untile_columns (numpy and jax) are inverses; tiled_rows gathers
  stored rows from the tiles; O not a multiple of 16 is refused."""
  rng = np.random.default_rng(bits)
  codes = rng.integers(0, 256, (48, 256 * bits // 8), dtype=np.uint8)
  scale = rng.random((48, 8)).astype(np.float16)
  offset = rng.random((48, 8)).astype(np.float16)
  supers = rng.random((48, 1)).astype(np.float16)  # e.g. a K-quant's per-256 values
  tiled = matvec.tile_columns(codes, bits, scale, offset, None, supers)
  assert not np.array_equal(tiled[0], codes) and tiled[3] is None
  for back in (matvec.untile_columns(tiled[0], bits, *tiled[1:]),
               matvec.untile_columns(jnp.asarray(tiled[0]), bits, *map(
                   lambda a: None if a is None else jnp.asarray(a), tiled[1:]))):
    assert back[3] is None
    for got, want in zip(back[:3] + back[4:], (codes, scale, offset, supers), strict=True):
      assert np.array_equal(np.asarray(got), want)
  ids = np.array([[0, 15, 16], [47, 31, 2]])
  rows = matvec.tiled_rows(jnp.asarray(tiled[0]), bits, jnp.asarray(ids),
                           jnp.asarray(tiled[1]), jnp.asarray(tiled[2]), None,
                           jnp.asarray(tiled[4]))
  assert rows[3] is None
  for got, want in zip(rows[:3] + rows[4:], (codes, scale, offset, supers), strict=True):
    assert np.array_equal(np.asarray(got), want[ids])
  with pytest.raises(ValueError, match="multiple of 16"):
    matvec.tile_columns(codes[:40], bits, scale[:40])


# ---- K-quants ----

K_TYPES = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}


def kquant_block_exact_reference(x, fmt, qw, bits):
  """The module docstring's K-quant numerics for x [B, I] and a K-quant weight."""
  hi, lo, dx, xsum8, xsum16 = _rounded_rows(x, bits)
  act = hi * 256 + lo if bits == 16 else hi  # [B, G, 32]
  codes = np.asarray(quant.unpack_codes(qw, qw.q, qw.q_high)).astype(np.int64)
  codes = codes.reshape(codes.shape[0], -1, 32)  # [O, G, 32]
  d = np.asarray(quant._per_group(qw, qw.scale, qw.super_scale))  # [O, G] (Q6_K [O, 2G])
  groups = act.shape[1]
  acc = np.zeros((x.shape[0], codes.shape[0]), np.float32)
  mins = np.zeros_like(acc)
  if fmt == "q6_k":  # per 16 inputs: (code - 32) x
    halves = np.einsum("bghi,oghi->bogh", act.reshape(*act.shape[:2], 2, 16),
                       codes.reshape(*codes.shape[:2], 2, 16))
    halves -= 32 * act.reshape(*act.shape[:2], 2, 16).sum(-1)[:, None]
    assert np.abs(halves).max() < 2**31
    halves = halves.astype(np.int32).astype(np.float32)
    for g in range(groups):
      for h in range(2):
        scale = (dx[:, None, g] * d[None, :, 2 * g + h]).astype(np.float32)
        acc = _fma32(halves[:, :, g, h], scale, acc)
    return (acc * np.float32(1 / 256 if bits == 16 else 1)).astype(np.float32)
  isum = np.einsum("bgi,ogi->bog", act, codes)
  assert np.abs(isum).max() < 2**31
  isum = isum.astype(np.int32).astype(np.float32)
  m = np.asarray(quant._per_group(qw, qw.offset, qw.super_offset))
  xsum = xsum16 if bits == 16 else xsum8
  for g in range(groups):
    acc = _fma32(isum[:, :, g], (dx[:, None, g] * d[None, :, g]).astype(np.float32), acc)
    mins = _fma32(np.broadcast_to(m[None, :, g], acc.shape),
                  np.broadcast_to(xsum[:, None, g], acc.shape), mins)
  return _fma32(acc, np.full_like(acc, np.float32(1 / 256 if bits == 16 else 1)), mins)


def _kweight(fmt, out_dim, in_dim):
  return jax.tree.map(jnp.asarray, random_weight(np.random.default_rng(5), K_TYPES[fmt],
                                                 out_dim, in_dim))


def _kproduct(x, fmt, qw, bits):
  return np.asarray(matvec.kquant_matvec(jnp.asarray(x), fmt, qw.q, qw.scale, qw.offset,
                                         qw.q_high, qw.super_scale, qw.super_offset,
                                         activation_bits=bits))


@needs_vnni
@pytest.mark.parametrize("fmt", list(K_TYPES))
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 7, 16, 37])  # row tiles; AMX or packed tiles; both
def test_kquants_match_block_exact_reference_bitwise(fmt, bits, rows, monkeypatch):
  """Columns not a multiple of 16 (70), three super-blocks, an all-zero group; with AMX
  (Q4_K and Q5_K, where the CPU has it) and forced off."""
  qw = _kweight(fmt, 70, 768)
  x = np.random.default_rng(rows).standard_normal((rows, 768)).astype(np.float32)
  x[0, :32] = 0.0
  want = kquant_block_exact_reference(x, fmt, qw, bits)
  assert np.array_equal(_kproduct(x, fmt, qw, bits), want)
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  assert np.array_equal(_kproduct(x, fmt, qw, bits), want)


@needs_vnni
@pytest.mark.parametrize("fmt", list(K_TYPES))
def test_kquant_row_alone_is_bitwise_the_row_among_300(fmt):
  """Batch invariance across the row tiles (1 row) and the packed tiles of a 300-row
  call (several row blocks and column ranges)."""
  qw = _kweight(fmt, 1030, 1024)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((300, 1024)).astype(np.float32) * rng.uniform(0.1, 10.0, (300, 1))
  together = _kproduct(x, fmt, qw, 16)
  for at in (0, 150, 299):
    assert np.array_equal(_kproduct(x[at:at + 1], fmt, qw, 16)[0], together[at]), at


@needs_vnni
@pytest.mark.parametrize("fmt", list(matvec.TILED_K_FORMATS))
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 7, 16, 37])
def test_tiled_kquants_match_block_exact_reference_bitwise(fmt, bits, rows, monkeypatch):
  """Q4_K and Q6_K in the column-tiled layout (codes — Q6_K's nibbles re-paired per 32 —,
  scale and min codes, super-block values, Q6_K's high bits, re-laid per 16 columns,
  `tile_for_native`): the same reference as the stored rows, with AMX (where the CPU has
  it; Q6_K a product per 16-input half) and forced off, and a row alone among 300 keeps
  its bits."""
  qw = quant.with_activation_bits(_kweight(fmt, 80, 768), bits)
  tiled = quant.tile_for_native({"wq": qw})["wq"]
  assert tiled.layout == "tiles" and not np.array_equal(np.asarray(tiled.q), np.asarray(qw.q))
  run = lambda x: np.asarray(matvec.kquant_matvec(  # noqa: E731
      jnp.asarray(x), fmt, tiled.q, tiled.scale, tiled.offset, tiled.q_high,
      tiled.super_scale, tiled.super_offset, activation_bits=bits, tiled=True))
  x = np.random.default_rng(rows).standard_normal((rows, 768)).astype(np.float32)
  x[0, :32] = 0.0
  want = kquant_block_exact_reference(x, fmt, qw, bits)
  assert np.array_equal(run(x), want)
  np.testing.assert_array_equal(np.asarray(tiled.dequantize()), np.asarray(qw.dequantize()))
  with monkeypatch.context() as m:
    m.setenv("XLASERVE_NATIVE_AMX", "0")
    assert np.array_equal(run(x), want)
  if rows == 37:
    many = np.random.default_rng(9).standard_normal((300, 768)).astype(np.float32)
    together = run(many)
    assert np.array_equal(together, _kproduct(many, fmt, qw, bits))
    for at in (0, 299):
      assert np.array_equal(run(many[at:at + 1])[0], together[at])


def test_nibbles_by_32_round_trips():
  """Q6_K's per-16 nibble pairs <-> per-32 pairs, numpy and jax, on every byte value."""
  q = np.random.default_rng(1).integers(0, 256, (3, 48), dtype=np.uint8)
  by32 = matvec.nibbles_by_32(q)
  codes16 = np.concatenate([q.reshape(3, -1, 2, 8) & 15, q.reshape(3, -1, 2, 8) >> 4], -1)
  inputs = codes16.reshape(3, -1, 32)  # per 16: (j, j + 8) -> input order
  assert np.array_equal(by32.reshape(3, -1, 16) & 15, inputs[..., :16])
  assert np.array_equal(by32.reshape(3, -1, 16) >> 4, inputs[..., 16:])
  assert np.array_equal(matvec.nibbles_by_32(by32, inverse=True), q)
  assert np.array_equal(np.asarray(matvec.nibbles_by_32(jnp.asarray(by32), inverse=True)), q)


@needs_vnni
def test_amx_reported_where_the_cpu_has_it(monkeypatch):
  """The library uses AMX exactly where /proc/cpuinfo lists amx_int8 (Linux grants the
  tile state to a process that asks), and not when XLASERVE_NATIVE_AMX=0."""
  lib = ctypes.CDLL(library.library_path())
  try:
    with open("/proc/cpuinfo") as f:
      flags = f.read()
  except OSError:
    pytest.skip("no /proc/cpuinfo")
  assert lib.xlaserve_native_amx() == (1 if " amx_int8" in flags else 0)
  monkeypatch.setenv("XLASERVE_NATIVE_AMX", "0")
  assert lib.xlaserve_native_amx() == 0


# ---- The AVX2 set (quant_dot_avx2.h), forced on this CPU ----

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rows", [1, 3, 6, 70])  # 1-4-row tiles, partial tiles, row blocks
def test_avx2_matches_block_exact_reference_bitwise(force_avx2, fmt, bits, rows, monkeypatch):
  """Columns not a multiple of the 8-column tiles (70), 18 groups, an all-zero group;
  with AVX-VNNI where the CPU has it and with it off (the same integers)."""
  qw = _weight(fmt, 70, 576)
  x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32)
  x[0, :32] = 0.0
  want = block_exact_reference(x, fmt, qw.q, qw.scale, qw.offset, bits)
  traced = str(jax.make_jaxpr(lambda x: matvec.quantized_matvec(
      x, qw.q, qw.scale, qw.offset, qw.bits, activation_bits=bits))(jnp.asarray(x)))
  assert "_avx2" in traced
  assert np.array_equal(_product(x, qw, bits), want)
  monkeypatch.setenv("XLASERVE_NATIVE_AVXVNNI", "0")
  assert np.array_equal(_product(x, qw, bits), want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_row_alone_is_bitwise_the_row_among_150(force_avx2, fmt):
  """Batch invariance on the AVX2 set: 1-row tiles vs 4-row tiles, partial tiles and
  several row blocks (150 rows), over column ranges of several threads (1030 columns)."""
  out_dim, in_dim = 1030, 1024
  qw = _weight(fmt, out_dim, in_dim)
  rng = np.random.default_rng(3)
  x = rng.standard_normal((150, in_dim)).astype(np.float32) * rng.uniform(0.1, 10.0, (150, 1))
  together = _product(x, qw, 16)
  for at in (0, 65, 149):
    assert np.array_equal(_product(x[at:at + 1], qw, 16)[0], together[at]), at
