"""No code execution from data: the package source never unpickles, evals or trusts remote code.

Model files are loaded as tensors (safetensors, GGUF, orbax arrays) and
configs as JSON; nothing in a checkpoint or a request can run code. This
scan keeps it that way: it fails on any use of pickle-based loading,
`trust_remote_code`, `eval(` / `exec(`, unsafe YAML, shell commands or
dynamic imports of request-controlled names in the shipped packages.

One exception is allowed, by file and rule: the executable store
(serving/runner/executable_store.py) pickles compiled programs into the local
compilation-cache directory and loads them back, through
`jax.experimental.serialize_executable`, which is pickle-based. That is the
trust boundary of JAX's own persistent cache (which loads machine code from
the same directory): files this server wrote, in a directory only its user
can write (the store refuses other files), never a checkpoint or a request.
"""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("serving", "checkpoints", "sharding", "kernels_pallas", "configs")
FORBIDDEN = {
    "pickle": re.compile(r"\b(c?pickle|dill|joblib|marshal|shelve)\b"),
    "trust_remote_code": re.compile(r"trust_remote_code"),
    "eval/exec": re.compile(r"(?<![\w.])(eval|exec)\s*\("),
    "torch.load": re.compile(r"\btorch\.load\b"),
    "allow_pickle": re.compile(r"allow_pickle\s*=\s*True"),
    "unsafe yaml": re.compile(r"\byaml\.(unsafe_)?load\s*\("),
    "shell": re.compile(r"shell\s*=\s*True|\bos\.system\s*\(|\bos\.popen\s*\("),
    "__import__": re.compile(r"\b__import__\s*\("),
}


ALLOWED = {("serving/runner/executable_store.py", "pickle")}


def package_sources() -> list[str]:
  out = []
  for pkg in PACKAGES:
    for root, _, files in os.walk(os.path.join(REPO, pkg)):
      out += [os.path.join(root, f) for f in files
              if f.endswith(".py") and not f.endswith(("_pb2.py", "_pb2_grpc.py"))]
  return sorted(out)


def scan(text: str) -> list[str]:
  return [name for name, pattern in FORBIDDEN.items() if pattern.search(text)]


def test_scanner_finds_what_it_looks_for():
  bad = ["import pickle", "m = AutoModel.from_pretrained(p, trust_remote_code=True)",
         "x = eval(s)", "exec(code)", "torch.load(f)", "np.load(f, allow_pickle=True)",
         "yaml.load(f)", "subprocess.run(c, shell=True)", "__import__(name)"]
  for line in bad:
    assert scan(line), line
  for line in ("model.eval()", "jax.eval_shape(f, x)", "yaml.safe_load(f)", "executor(x)"):
    assert not scan(line), line


def test_package_source_is_clean():
  files = package_sources()
  assert len(files) > 20
  hits = []
  for path in files:
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        code = line.split("#", 1)[0]
        for name in scan(code):
          if (os.path.relpath(path, REPO), name) in ALLOWED:
            continue
          hits.append(f"{os.path.relpath(path, REPO)}:{n}: {name}: {line.strip()}")
  assert not hits, "\n".join(hits)
