"""The Bazel files are well-formed Starlark and cover every pytest file (Bazel is not installed
in CI, so this is a static check; README.md, "Bazel", says what `bazel test` runs)."""

from __future__ import annotations

import ast
import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARLARK = ["BUILD", "tests/BUILD", "tests/pytest.bzl", "deploy/BUILD", "notebooks/BUILD"]


def test_starlark_files_parse():
  for rel in STARLARK:
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
      ast.parse(f.read(), filename=rel)  # Starlark's syntax is a subset of Python's


def test_version_pinned_and_workspace_root():
  with open(os.path.join(REPO, ".bazelversion"), encoding="utf-8") as f:
    assert re.fullmatch(r"\d+\.\d+\.\d+\n?", f.read())
  assert os.path.exists(os.path.join(REPO, "WORKSPACE"))


def test_every_test_file_is_a_target():
  with open(os.path.join(REPO, "tests", "BUILD"), encoding="utf-8") as f:
    build = f.read()
  assert 'glob(["**/test_*.py"])' in build
  tests = glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)
  assert tests
  for path in tests:  # a BUILD file below tests/ would hide its directory from the glob
    rel = os.path.relpath(os.path.dirname(path), os.path.join(REPO, "tests"))
    parts = [] if rel == "." else rel.split(os.sep)
    for i in range(1, len(parts) + 1):
      assert not os.path.exists(os.path.join(REPO, "tests", *parts[:i], "BUILD")), path
  with open(os.path.join(REPO, "BUILD"), encoding="utf-8") as f:
    root = f.read()
  for pkg in ("serving", "kernels_pallas", "sharding", "checkpoints", "configs"):
    assert f'"{pkg}/**/*.py"' in root
    assert not os.path.exists(os.path.join(REPO, pkg, "BUILD")), pkg
