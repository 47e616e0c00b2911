"""The engine on the Pallas kernel path equals the XLA path (default model).

The kernels run in Pallas interpret mode on CPU (`attention_backend=
"pallas_interpret"`); greedy output must be token-identical to the XLA
reference path that `default_llm` uses.
"""

from serving import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def add(a, b):"]


def test_kernel_path_matches_xla_path(default_llm):
  params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  kernel_llm = LLM("smollm2-135m-instruct", max_num_seqs=2, max_model_len=128, num_pages=24,
                   max_num_batched_tokens=32, unroll_layers=False, dtype="float32",
                   weight_dtype="float32",
                   attention_backend="pallas_interpret")
  assert kernel_llm.engine.runner.backend == "pallas_interpret"
  kernel_out = [o.token_ids for o in kernel_llm.generate(PROMPTS, params)]
  xla_out = [o.token_ids for o in default_llm.generate(PROMPTS, params)]
  assert default_llm.engine.runner.backend == "xla"
  assert kernel_out == xla_out
