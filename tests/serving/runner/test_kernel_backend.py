"""The engine on the Pallas kernel path equals the XLA path.

The kernels run in Pallas interpret mode on CPU (`attention_backend=
"pallas_interpret"`); greedy output must be token-identical to the XLA
reference path: on the default model (`default_llm`), and on a tiny model
with an int8 KV cache, whose quantized pages the kernels read directly.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import testing as kernel_testing
from serving import LLM, SamplingParams
from serving.runner import attention, kv_cache

PROMPTS = ["The capital of France is", "def add(a, b):"]


@pytest.mark.slow
def test_kernel_path_matches_xla_path(default_llm):
  params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  # Only the 2-row decode bucket the two prompts use (and its multi-step call): each
  # program runs the kernels in interpret mode, slow to compile; the 1-row ones never ran.
  kernel_llm = LLM("smollm2-135m-instruct", max_num_seqs=2, max_model_len=128, num_pages=24,
                   max_num_batched_tokens=32, decode_buckets=(2,), unroll_layers=False,
                   dtype="float32", weight_dtype="float32", quantization=None,
                   attention_backend="pallas_interpret")
  assert kernel_llm.engine.runner.backend == "pallas_interpret"
  kernel_out = [o.token_ids for o in kernel_llm.generate(PROMPTS, params)]
  xla_out = [o.token_ids for o in default_llm.generate(PROMPTS, params)]
  assert default_llm.engine.runner.backend == "xla"
  assert kernel_out == xla_out


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_kernel_page_layout_is_the_kv_cache_layout(dtype):
  """kernels_pallas' quantized layout (its tests' quantizer) is byte-identical to the cache's."""
  x = np.random.default_rng(0).standard_normal((3, 5, 2, 16)).astype(np.float32)
  x[1, 2] = 0.0  # an all-zero row: scale 0
  np.testing.assert_array_equal(np.asarray(kv_cache.quantize_rows(jnp.asarray(x), dtype)),
                                np.asarray(kernel_testing.quantize_pages(x, dtype)))


def _pallas_call_operands(fn, *args):
  """Dtypes and shapes of every pallas_call operand in fn's jaxpr."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found.extend((v.aval.dtype, v.aval.shape) for v in eqn.invars)
    for sub in jax.extend.core.subjaxprs(jaxpr):
      walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_pallas_path_reads_quantized_pool(dtype):
  """The kernels get the uint8 pool itself (no dequantized copy) and match the XLA path."""
  rng = np.random.default_rng(1)
  layers, pages, page_size, nk, h = 2, 6, 16, 2, 16
  k = rng.standard_normal((layers * pages, page_size, nk, h)).astype(np.float32)
  v = rng.standard_normal(k.shape).astype(np.float32)
  kv = kv_cache.KVCache(k=kv_cache.quantize_rows(jnp.asarray(k), dtype),
                        v=kv_cache.quantize_rows(jnp.asarray(v), dtype), num_pages=pages,
                        dtype=dtype)
  tables = jnp.asarray([[7, 9, 8, 0], [11, 10, 0, 0]], jnp.int32)  # layer 1's pages
  lens = jnp.asarray([40, 17], jnp.int32)
  q = jnp.asarray(rng.standard_normal((2, 2 * nk, h)), jnp.float32)
  opts = dict(scale=h ** -0.5, block_tokens=32)

  def decode(backend):
    return lambda q, kv: attention.decode_attention(backend, q, kv, tables, lens, **opts)[0]

  operands = _pallas_call_operands(decode("pallas_interpret"), q, kv)
  assert (jnp.dtype(jnp.uint8), kv.k.shape) in operands
  assert not any(shape[-1] == h and len(shape) == 4 and shape[0] == layers * pages
                 for _, shape in operands), "a dequantized pool reached the kernel"
  np.testing.assert_allclose(jax.jit(decode("pallas_interpret"))(q, kv),
                             jax.jit(decode("xla"))(q, kv), rtol=2e-5, atol=2e-5)
  cu = jnp.asarray([0, 3, 4], jnp.int32)
  qr = jnp.asarray(rng.standard_normal((6, 2 * nk, h)), jnp.float32)

  def ragged(backend):
    return lambda q, kv: attention.ragged_attention(backend, q, kv, tables, cu, lens,
                                                    **opts)[0]

  np.testing.assert_allclose(jax.jit(ragged("pallas_interpret"))(qr, kv)[:4],
                             jax.jit(ragged("xla"))(qr, kv)[:4], rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
  tiny_models = pytest.importorskip("tiny_models")
  path = tmp_path_factory.mktemp("tiny") / "llama"
  tiny_models.save_tiny_model("llama", str(path))  # head_dim 16, 4 q / 2 kv heads, 2 layers
  return str(path)


def test_int8_kv_kernel_path_matches_xla_path(tiny_llama):
  # Only the 2-row decode bucket the two prompts use (as above).
  engine = dict(max_num_seqs=2, max_model_len=64, num_pages=16, max_num_batched_tokens=32,
                decode_buckets=(2,), dtype="float32", unroll_layers=False,
                kv_cache_dtype="int8")
  params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
  prompts = ["hello world", "abc"]
  kernel_llm = LLM(tiny_llama, attention_backend="pallas_interpret", **engine)
  assert kernel_llm.engine.runner.backend == "pallas_interpret"
  assert kernel_llm.engine.runner.kv_dtype_name == "int8"
  kernel_out = [o.token_ids for o in kernel_llm.generate(prompts, params)]
  xla_llm = LLM(tiny_llama, attention_backend="xla", **engine)
  xla_out = [o.token_ids for o in xla_llm.generate(prompts, params)]
  assert kernel_out == xla_out
  assert all(len(t) == 6 for t in kernel_out)
