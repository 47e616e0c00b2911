"""Batch-1 decode of a Llama-3.2-1B-shaped Q4_K_M-like GGUF: native K-quant kernels vs XLA.

    PYTHONPATH=. python benchmarks/kquant_decode_bench.py [--tokens 32] [--rounds 2]

Writes (once, to --path) a random-weight GGUF of Llama-3.2-1B's shape (hidden
2048, 16 layers, 32 / 8 heads, FFN 8192) with the default model's tokenizer
(49,152 tokens) and llama.cpp's Q4_K_M type choice: Q4_K matrices, Q6_K for
attn_v and ffn_down in the layers llama.cpp gives more bits (the first and last
eighth, every third between) and for the tied embedding / head. gguf-py has no
K-quant quantizer, so the blocks are random bytes with float16 super-block
scales that keep the weights near 0.02 (speed does not depend on the values).

Each round serves the file with `quantization="gguf"` (blocks as stored) in a
fresh process, once with the native kernels and once with `XLASERVE_NATIVE=0`
(the XLA path: dequantize inside the step, then XLA's dot), alternating, and
reports decode tok/s at batch 1: (tokens - 1) / (the time of a `tokens`-token
generation minus that of a 1-token one), medians over rounds. Both paths run
under the same load from other processes only approximately: compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 2048, 16, 32, 8, 8192
_SUPER_AT = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}
_TOP = {Q.Q4_K: 15 * 63, Q.Q6_K: 32 * 127}  # largest |code x scale code|


def more_bits(i: int, n: int) -> bool:
  """llama.cpp's `use_more_bits`: the layers whose attn_v / ffn_down Q4_K_M makes Q6_K."""
  return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rng, qtype, rows: int, cols: int, scale: float = 0.02) -> np.ndarray:
  """uint8 GGUF blocks of a `[rows, cols]` K-quant tensor: random codes, sane scales."""
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  for at in _SUPER_AT[qtype]:
    d = (rng.uniform(0.5, 1.0, raw.shape[:2]) * scale / _TOP[qtype] * 4).astype(np.float16)
    raw[..., at:at + 2] = d[..., None].view(np.uint8)
  return raw.reshape(rows, -1)


def write_model(path: str) -> None:
  """The Q4_K_M-like 1B file (module doc)."""
  import checkpoints
  from checkpoints import gguf_reader

  fields = gguf_reader.open_gguf(checkpoints.resolve_model_path("smollm2-135m-instruct")).fields
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(path + ".tmp", "llama")
  for key, value in fields.items():
    if not key.startswith("tokenizer."):
      continue
    add = (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int)
           else w.add_string if isinstance(value, str) else w.add_array)
    add(key, value)
  vocab = len(fields["tokenizer.ggml.tokens"])
  w.add_vocab_size(vocab)
  w.add_context_length(8192)
  w.add_embedding_length(HIDDEN)
  w.add_block_count(LAYERS)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  w.add_rope_dimension_count(HIDDEN // HEADS)
  w.add_rope_freq_base(500000.0)
  w.add_layer_norm_rms_eps(1e-5)
  kv = KV_HEADS * HIDDEN // HEADS
  w.add_tensor("token_embd.weight", random_blocks(rng, Q.Q6_K, vocab, HIDDEN), raw_dtype=Q.Q6_K)
  w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
  for i in range(LAYERS):
    big = Q.Q6_K if more_bits(i, LAYERS) else Q.Q4_K
    for name, rows, cols, qtype in (("attn_q", HIDDEN, HIDDEN, Q.Q4_K),
                                    ("attn_k", kv, HIDDEN, Q.Q4_K), ("attn_v", kv, HIDDEN, big),
                                    ("attn_output", HIDDEN, HIDDEN, Q.Q4_K),
                                    ("ffn_gate", FFN, HIDDEN, Q.Q4_K),
                                    ("ffn_up", FFN, HIDDEN, Q.Q4_K),
                                    ("ffn_down", HIDDEN, FFN, big)):
      w.add_tensor(f"blk.{i}.{name}.weight", random_blocks(rng, qtype, rows, cols),
                   raw_dtype=qtype)
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  os.replace(path + ".tmp", path)


def measure(path: str, tokens: int) -> dict:
  """Decode tok/s at batch 1 in this process (module doc)."""
  import time

  from serving import LLM, SamplingParams

  llm = LLM(path, quantization="gguf", max_num_seqs=1, max_model_len=512,
            compilation_cache=False)
  prompt = "The history of the city begins"

  def run(n):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - start

  run(tokens)  # warm-up: compiles every step shape
  one, full = min(run(1) for _ in range(2)), min(run(tokens) for _ in range(2))
  return dict(tok_s=(tokens - 1) / (full - one), one_token_s=one)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--path", default=os.path.expanduser(
      "~/.cache/xlaserve/random-ggufs/kquant-bench-llama3.2-1b-q4_k_m-like.gguf"))
  ap.add_argument("--tokens", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--paths", default="native,xla")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child:
    print(json.dumps(measure(args.path, args.tokens)))
    return
  if not os.path.exists(args.path):
    os.makedirs(os.path.dirname(args.path), exist_ok=True)
    write_model(args.path)
  results = {p: [] for p in args.paths.split(",")}
  for _ in range(args.rounds):
    for name in results:
      env = dict(os.environ, XLASERVE_NATIVE="0" if name == "xla" else "1")
      out = subprocess.run([sys.executable, __file__, "--child", name, "--path", args.path,
                            "--tokens", str(args.tokens)], env=env, capture_output=True,
                           text=True, check=True)
      results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(name, results[name][-1], flush=True)
  for name, runs in results.items():
    print(f"{name}: batch-1 decode {statistics.median(r['tok_s'] for r in runs):.2f} tok/s "
          f"(rounds: {[round(r['tok_s'], 2) for r in runs]})")


if __name__ == "__main__":
  main()
