"""The real default model against `transformers` loading the same GGUF.

Both sides dequantize SmolLM2-135M-Instruct (Q4_1/Q8_0) to float32; greedy
32-token continuations of varied prompts, run as one concurrent batch
through our engine, must be token-identical to a greedy loop in torch.
"""

import os

import numpy as np
import pytest
import torch

from checkpoints import resolve_model_path
from serving import SamplingParams

pytestmark = pytest.mark.slow  # the default model against transformers

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash map is in one sentence.",
    "List three prime numbers.",
    "Translate 'good morning' to Spanish.",
]
RAW = [
    "def fibonacci(n):\n",
    "The quick brown fox",
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="module")
def hf_model():
  import transformers
  path = resolve_model_path("smollm2-135m-instruct")
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def torch_greedy(model, ids: list[int], n: int) -> list[int]:
  out = []
  with torch.no_grad():
    res = model(torch.tensor([ids]), use_cache=True)
    for _ in range(n):
      nxt = int(torch.argmax(res.logits[0, -1]))
      out.append(nxt)
      res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
  return out


def test_greedy_matches_transformers(default_llm, hf_model):
  tok = default_llm.get_tokenizer()
  prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}],
                                                add_generation_prompt=True))
             for c in CHAT]
  prompts += [tok.encode(t, add_special_tokens=True) for t in RAW]
  params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
  outs = default_llm.generate(prompts, params)
  for ids, out in zip(prompts, outs, strict=True):
    assert out.token_ids == torch_greedy(hf_model, ids, 32), tok.decode(ids)
    assert out.finish_reason == "length"


def test_generate_text_and_chat(default_llm):
  out = default_llm.generate(["The capital of France is"],
                             SamplingParams(max_tokens=8, temperature=0.0))[0]
  assert "Paris" in out.text
  chat = default_llm.chat([{"role": "user", "content": "Say hello."}],
                          SamplingParams(max_tokens=16, temperature=0.0))[0]
  assert chat.text and chat.finish_reason in ("stop", "length")
  assert np.all(np.array(chat.token_ids) < 49152)


def test_explicit_dtype_wins_over_the_presets_weight_dtype(default_llm):
  """The preset keeps bfloat16 weights; `LLM(dtype="float32")` alone must give float32
  weights (the same model, and so the same tokens, as float32 set both ways)."""
  from server_procs import DEFAULT_MODEL, DEFAULT_MODEL_TEST_CONFIG

  from serving import LLM

  options = {k: v for k, v in DEFAULT_MODEL_TEST_CONFIG.items() if k != "weight_dtype"}
  llm = LLM(DEFAULT_MODEL, **options)
  assert llm.engine.runner.weight_dtype_name == "float32"
  params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  assert llm.generate(RAW, params)[0].token_ids == default_llm.generate(RAW, params)[0].token_ids
