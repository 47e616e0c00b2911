"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel (nbclient).

The kernel gets two simulated CPU devices, so the sharded section runs
(`tp=2`); it uses a tiny random Llama from tests/tiny_models.py to keep the
extra compile short. The notebook's engine settings are tiny (2 slots, one
prefill bucket), so a cold compile cache costs few programs: the simulated
devices change XLA's flags and with them every compilation cache key.
"""

from __future__ import annotations

import os

import pytest
from server_procs import xla_flags

pytestmark = pytest.mark.slow  # executes the notebook

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
  import nbclient
  import nbformat
  from ops_procs import require_real_model

  from tiny_models import save_tiny_model

  require_real_model()
  tiny = str(tmp_path / "tiny-llama")
  save_tiny_model("llama", tiny)
  cache = os.environ.get("XLASERVE_TEST_CACHE", os.path.join(REPO, ".jax_cache"))
  for name, value in {"JAX_PLATFORMS": "cpu", "XLASERVE_CACHE_DIR": os.path.abspath(cache),
                      "XLA_FLAGS": xla_flags(2),
                      "QUICKSTART_SHARDED_MODEL": tiny,
                      "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
                      }.items():
    monkeypatch.setenv(name, value)
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": REPO}})
  try:
    client.execute()
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"notebook cell failed:\n{e}")
  # The kernel flushes stdout on a timer, so one print can arrive as several stream outputs
  # ("2", " devices: ..."): join them as they were written.
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", [])
                 if o.get("output_type") == "stream" and o.get("name") == "stdout")
  assert "deltas, finish_reason:" in text
  assert "2 devices" in text and "mesh:" in text  # the sharded section really ran
