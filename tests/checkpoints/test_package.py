"""The `checkpoints` package: its exports load on first use, and the launcher's flags
(which read `checkpoints.presets`) import neither jax nor numpy."""

import subprocess
import sys

import pytest

import checkpoints


def test_every_export_resolves_to_its_module():
  assert checkpoints.__all__ == sorted(checkpoints._EXPORTS)
  for name, module in checkpoints._EXPORTS.items():
    assert getattr(checkpoints, name).__module__ == module, name


def test_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no_such_loader"):
    checkpoints.no_such_loader  # noqa: B018


def test_the_launcher_imports_no_jax():
  code = "import sys, serving.launcher; print(sorted({'jax', 'numpy'} & set(sys.modules)))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
