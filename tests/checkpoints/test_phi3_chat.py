"""Phi-3's chat template, special tokens and end-of-generation ids, from the checkpoint.

Phi-3 ends a turn with <|end|> and its generation_config lists <|endoftext|>,
<|assistant|> and <|end|> as EOS (config.json names only <|endoftext|>); a
GGUF file names <|endoftext|> as EOS and carries <|end|> in its vocabulary,
which llama.cpp (and we) treat as an end-of-generation token by name.
"""

import pytest
import transformers
from ckpt_testutil import gguf_from_model, tiny_model

from checkpoints import load_checkpoint
from tiny_models import PHI3_CHAT_TEMPLATE, PHI3_GENERATION_EOS, save_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi \"there\" 😀"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("phi3"))
  save_tiny_model("phi3", path)
  return path


def test_hf_eos_ids_and_template_match_transformers(phi3_dir):
  loaded = load_checkpoint(phi3_dir)
  ref = transformers.AutoTokenizer.from_pretrained(phi3_dir)
  end = ref.convert_tokens_to_ids("<|end|>")
  assert loaded.config.eos_token_ids[0] == ref.convert_tokens_to_ids("<|endoftext|>")
  # generation_config's three, plus the vocabulary's </s>, an end by its name
  assert end in PHI3_GENERATION_EOS
  assert set(loaded.config.eos_token_ids) == {*PHI3_GENERATION_EOS,
                                              ref.convert_tokens_to_ids("</s>")}
  tok = loaded.tokenizer
  for agp in (True, False):
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=agp)
    got = tok.apply_chat_template(MESSAGES, add_generation_prompt=agp)
    assert got == want
    assert tok.encode(got) == ref.encode(want, add_special_tokens=False)
  assert tok.encode("<|user|>x<|end|>") == [ref.convert_tokens_to_ids("<|user|>"), ord("x"), end]


def test_gguf_eos_ids_and_template(tmp_path):
  model = tiny_model("phi3", seed=6)
  path = str(tmp_path / "phi3.gguf")
  gguf_from_model(model, path, "phi3", chat_template=PHI3_CHAT_TEMPLATE)
  tok = load_checkpoint(path).tokenizer
  eos, end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|end|>")
  assert load_checkpoint(path).config.eos_token_ids == (eos, end)
  assert tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True) == (
      "<|system|>Be brief.<|end|><|user|>Hi \"there\" 😀<|end|><|assistant|>")
