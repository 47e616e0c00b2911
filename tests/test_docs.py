"""Docs and comments name only modules and files that exist.

Scans docs/*.md, README.md and the comments and docstrings of the repository's
Python files for
  * dotted names rooted in our packages, backticked or plain
    (`serving.runner.kv_cache`, `checkpoints.layout.ParamsBuilder`; not
    `jax.numpy` or `self.serving.x`): the longest prefix that is a module or
    package must exist, and a name after it must be defined at the top level of
    that module (a def, class, assignment, import or `__all__` entry); anything
    after that is taken as an attribute of it;
  * paths under our top-level folders (`serving/runner/kv_cache.py`,
    tests/ops/, `configs/*.json`), backticked or plain: they must exist (globs
    must match).
No jax, no imports of the code: the modules are read as files and parsed with
`ast`.
"""

from __future__ import annotations

import ast
import functools
import glob
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("serving", "checkpoints", "sharding", "kernels_pallas", "kernels_cpu", "configs")
FOLDERS = (*PACKAGES, "tests", "benchmarks", "docs", "deploy", "notebooks")
BUILT = (".so",)  # build outputs a doc may name: not checked
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__",
             "bazel-bin", "bazel-out", "bazel-testlogs", "shared"}

# A dotted name starts where no identifier, attribute access or path goes on before it.
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
# A path starts at a word boundary that is not part of a longer path, URL, option or label.
PATH = re.compile(rf"(?<![\w./:=~$-])((?:\.\./)*(?:{'|'.join(FOLDERS)})/[\w./*-]*)")


def repo_files(ext: str) -> list[str]:
  out = []
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith((".", "bazel-"))
                   and not d.endswith(".egg-info")]
    out += [os.path.join(dirpath, f) for f in filenames if f.endswith(ext)]
  return sorted(out)


def doc_files() -> list[str]:
  return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]


def python_prose(path: str) -> str:
  """The comments and docstrings of a Python file, one per line."""
  with open(path, encoding="utf-8") as f:
    source = f.read()
  parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        parts.append(doc)
  return "\n".join(parts)


def module_file(parts: tuple[str, ...]) -> str | None:
  """The file defining the module `parts` (a package's __init__.py), if it exists."""
  base = os.path.join(ROOT, *parts)
  if os.path.isfile(base + ".py"):
    return base + ".py"
  if os.path.isfile(os.path.join(base, "__init__.py")):
    return os.path.join(base, "__init__.py")
  return None


@functools.cache
def defined_names(path: str) -> frozenset[str]:
  """Names a module defines at its top level (incl. `if` / `try` blocks and `__all__`)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names: set[str] = set()
  todo = list(tree.body)
  while todo:
    node = todo.pop()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for target in targets:
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
      if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
        names.update(c.value for c in ast.walk(node.value)
                     if isinstance(c, ast.Constant) and isinstance(c.value, str))
    elif isinstance(node, ast.If):
      todo += node.body + node.orelse
    elif isinstance(node, ast.Try):
      todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
  return frozenset(names)


def dotted_problem(name: str) -> str | None:
  """Why `name` does not resolve (None when it does)."""
  parts = tuple(name.split("."))
  for i in range(len(parts), 0, -1):
    path = module_file(parts[:i])
    if path is None:
      continue
    if i == len(parts) or parts[i] in defined_names(path):
      return None
    return f"{'.'.join(parts[:i])} has no {parts[i]!r}"
  return "no such package"


def path_problem(path: str, source: str) -> str | None:
  """Why `path` (as written in `source`) does not exist (None when it does)."""
  if path.endswith(BUILT):
    return None  # made by `pip install` (setup.py), absent from a fresh checkout
  base = os.path.dirname(source) if path.startswith("../") else ROOT
  target = os.path.normpath(os.path.join(base, path.rstrip(".")))
  if any(c in path for c in "*?["):
    return None if glob.glob(target, recursive=True) else "matches nothing"
  return None if os.path.exists(target) else "does not exist"


def references(text: str):
  """(kind, reference) pairs in `text`."""
  for m in DOTTED.finditer(text):
    yield "module", m.group(1)
  for m in PATH.finditer(text):
    yield "path", m.group(1)


def sources() -> list[tuple[str, str]]:
  """(file, text to check) for every doc and Python file."""
  out = []
  for path in doc_files():
    with open(path, encoding="utf-8") as f:
      out.append((path, f.read()))
  out += [(path, python_prose(path)) for path in repo_files(".py")]
  return out


def problems_in(path: str, text: str) -> list[str]:
  found = []
  for kind, ref in references(text):
    why = dotted_problem(ref) if kind == "module" else path_problem(ref, path)
    if why:
      found.append(f"{os.path.relpath(path, ROOT)}: {ref} ({why})")
  return found


def test_docs_and_comments_name_only_what_exists():
  problems = [p for path, text in sources() for p in problems_in(path, text)]
  assert not problems, "stale names:\n" + "\n".join(sorted(set(problems)))


@pytest.mark.parametrize("text, expected", [
    ("see `serving.runner.kv_cache`", []),
    ("`serving.runner.kv_cache.create_kv_cache(cfg, ...)`", []),
    ("`checkpoints.layout.ParamsBuilder.put`", []),
    ("`jax.numpy` and `numpy.testing` are not ours", []),
    ("`serving.runner.no_such_module`", ["serving.runner has no 'no_such_module'"]),
    ("`sharding.rules.no_such_function`", ["sharding.rules has no 'no_such_function'"]),
    ("# onto the mesh by sharding.no_such_module", ["sharding has no 'no_such_module'"]),
    ("self.serving.config and x.sharding.spec are attributes", []),
    ("serving/runner/kv_cache.py and tests/ops/ and `configs/*.json`", []),
    ("serving/runner/no_such_file.py", ["does not exist"]),
    ("docs/no_such_doc.md and tests/ops/no_such_dir/", ["does not exist", "does not exist"]),
    ("`kernels_cpu/_native*.so` (built by pip install)", []),
    ("https://example.com/serving/x.py, --out=serving/x, //tests:serving/x", []),
])
def test_the_checker_itself(text, expected):
  found = problems_in(os.path.join(ROOT, "docs", "x.md"), text)
  assert len(found) == len(expected), found
  assert all(e in f for e, f in zip(expected, found, strict=True)), found
