"""Session fixtures for checkpoint tests: the real SmolLM2 GGUF, loaded once.

Loading it (ours: ~4 s; transformers' tokenizer from the GGUF: ~7 s) is the
slow part of these tests, so each is done at most once per session.
"""

import os

import pytest

from checkpoints import load_checkpoint, presets

PRESET = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm_path():
  try:
    return presets.resolve_preset(PRESET)
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm(smollm_path):
  """Our LoadedModel of the default GGUF (float32 numpy params)."""
  return load_checkpoint(smollm_path)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_path):
  """transformers' tokenizer built from the same GGUF file (the reference)."""
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(
      os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path))
