"""A Q4_K_M-like GGUF (Q4_K and Q6_K blocks, a Q6_K head) served as stored: the native
K-quant kernels give the XLA path's greedy tokens.

The file is a tiny Llama written with gguf-py's writer: random K-quant blocks
(gguf-py cannot quantize K-quants) for every linear weight and the output
head, as llama.cpp's Q4_K_M mixes them (attn_v and ffn_down Q6_K, the rest
Q4_K), a float32 embedding table and norms. With `quantization="gguf"` the
weights stay as blocks; the engine's decode steps then run the fused native
call over them, and with `XLASERVE_NATIVE=0` the XLA path (dequantize + dot).
"""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_testutil import add_tokenizer
from kquant_testutil import Q, random_blocks

import kernels_cpu
from kernels_cpu import library
from serving.models import quantized
from serving.runner import native_decode

DIM, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 261
# llama.cpp's Q4_K_M: Q6_K for attn_v and ffn_down (and the head), Q4_K elsewhere.
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
         "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
SHAPES = {"attn_q": (DIM, DIM), "attn_k": (DIM // 2, DIM), "attn_v": (DIM // 2, DIM),
          "attn_output": (DIM, DIM), "ffn_gate": (FFN, DIM), "ffn_up": (FFN, DIM),
          "ffn_down": (DIM, FFN)}


def write_q4_k_m(path: str, seed: int = 0) -> None:
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, "llama")
  for key, value in (("block_count", LAYERS), ("context_length", 256),
                     ("embedding_length", DIM), ("feed_forward_length", FFN),
                     ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS),
                     ("rope.dimension_count", DIM // HEADS), ("vocab_size", VOCAB)):
    w.add_uint32(f"llama.{key}", value)
  w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
  w.add_float32("llama.rope.freq_base", 10000.0)
  add_tokenizer(w)
  w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, DIM)).astype(np.float32))
  w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
  w.add_tensor("output.weight", random_blocks(rng, Q.Q6_K, VOCAB, DIM, scale=0.2),
               raw_dtype=Q.Q6_K)
  for i in range(LAYERS):
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(DIM, np.float32))
    for name, (rows, cols) in SHAPES.items():
      w.add_tensor(f"blk.{i}.{name}.weight",
                   random_blocks(rng, TYPES[name], rows, cols, scale=0.15),
                   raw_dtype=TYPES[name])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.slow
@pytest.mark.skipif(not kernels_cpu.available(), reason="native kernels not built")
def test_q4_k_m_greedy_tokens_match_the_xla_path(tmp_path, monkeypatch):
  from serving import LLM, SamplingParams

  path = str(tmp_path / "q4_k_m.gguf")
  write_q4_k_m(path)
  engine = dict(max_num_seqs=4, max_model_len=128, num_pages=32, max_num_batched_tokens=32,
                dtype="float32", quantization="gguf", compilation_cache=False)
  greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
  prompts = ["hello world", "the quick brown fox jumps", "a"]
  native = LLM(path, **engine)
  runner = native.engine.runner
  layers, head = runner.params["layers"], runner.params["lm_head"]
  assert {quantized.kquant_format(lp[k]) for lp in layers for k in quantized.LINEAR_KEYS} == {
      "q4_k", "q6_k"}
  assert quantized.kquant_format(head) == "q6_k" and head.runs_native(1)
  x = jnp.ones((1, DIM), jnp.float32)
  assert native_decode.runs_native(layers, runner.model_cfg, runner.state.kv, x, None)
  got = [o.token_ids for o in native.generate(prompts, greedy)]
  del native
  monkeypatch.setenv("XLASERVE_NATIVE", "0")
  library.isa.cache_clear()
  try:
    xla = LLM(path, **engine)
    assert not xla.engine.runner.params["lm_head"].runs_native(1)
    want = [o.token_ids for o in xla.generate(prompts, greedy)]
  finally:
    monkeypatch.delenv("XLASERVE_NATIVE")
    library.isa.cache_clear()
  assert got == want
  assert len({tuple(t) for t in got}) > 1 and any(len(set(t)) > 3 for t in got)  # not degenerate
