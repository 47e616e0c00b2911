"""`checkpoint_format`: how a model name loads, found without reading any weights, with the
errors loading would raise (the launcher's early model check, engine_builder.check_setup)."""

import json

import pytest

from checkpoints import checkpoint_format, load_checkpoint
from checkpoints.orbax_io import MARKER_FILE

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}


def test_formats_from_names_alone(tmp_path):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text(json.dumps(LLAMA_CONFIG))  # no weights at all
  assert checkpoint_format(str(hf_dir)) == "hf"
  assert checkpoint_format(str(hf_dir), "int8") == "hf"
  orbax_dir = tmp_path / "orbax"
  orbax_dir.mkdir()
  (orbax_dir / MARKER_FILE).write_text("{}")
  assert checkpoint_format(str(orbax_dir)) == "orbax"
  gguf = tmp_path / "m.gguf"
  gguf.write_bytes(b"")
  assert checkpoint_format(str(gguf), "gguf") == "gguf"


def test_errors_are_the_loaders(tmp_path):
  with pytest.raises(FileNotFoundError, match="is not a preset"):
    checkpoint_format(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="is not a preset"):
    load_checkpoint(str(tmp_path / "missing"))
  with pytest.raises(ValueError, match="unsupported model directory"):
    checkpoint_format(str(tmp_path))
  (tmp_path / "weights.bin").write_bytes(b"")
  with pytest.raises(ValueError, match="expected a .gguf file"):
    checkpoint_format(str(tmp_path / "weights.bin"))
  (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "model_type": "bert",
                                                     "architectures": ["BertModel"]}))
  with pytest.raises(ValueError, match="unsupported architecture"):
    checkpoint_format(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
  with pytest.raises(ValueError, match="is not a .gguf file"):
    checkpoint_format(str(tmp_path), "gguf")
  with pytest.raises(ValueError, match="unsupported quantization"):
    checkpoint_format(str(tmp_path), "int3")
