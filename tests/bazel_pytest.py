"""Runs one pytest file under Bazel (`bazel test //tests:serving/engine/test_engine`).

Bazel starts tests in the runfiles tree, the repository's layout, so pytest
finds pyproject.toml (its `pythonpath` and options) there as in a checkout.
"""

import os
import sys

import pytest

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]]))
