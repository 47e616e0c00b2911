"""The package layers hold: no module imports a layer above its own, and no import cycles.

The layers, bottom first (docs/structure.md has the diagram). A module may
import its own layer and the ones below it; `serving/__init__.py` (the public
`from serving import LLM, SamplingParams`) and the `xlaserve` command sit on
top. Imports are read with `ast` from the source (function-level imports
included), so the rule also covers lazy imports. The host side
(`serving.engine`, the shared vocabulary) must not reach jax at all.
The checker is tested on small trees with a deliberate upward import and a
deliberate cycle.
"""

from __future__ import annotations

import ast
import os
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("configs", "kernels_pallas", "kernels_cpu", "serving", "sharding", "checkpoints")
LAYERS = (
    ("configs",),
    ("kernels_pallas", "kernels_cpu"),
    ("serving.models",),
    ("sharding",),
    ("checkpoints",),
    ("serving.types", "serving.config"),
    ("serving.structured_output", "serving.spec_decode"),
    ("serving.runner",),
    ("serving.engine",),
    ("serving.entrypoints",),
    ("serving.tools",),
    ("serving.launcher", "serving"),
)
NO_JAX = ("serving.engine", "serving.types", "serving.config", "serving.structured_output",
          "serving.spec_decode")


def module_files(root: str) -> dict[str, str]:
  """Dotted module name -> file, for every .py file of our packages under `root`."""
  out = {}
  for pkg in PACKAGES:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      for f in filenames:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
          out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def imports_of(name: str, path: str, modules: dict[str, str]) -> set[str]:
  """Modules of ours that `name` imports: a submodule when the imported name is one."""
  is_pkg = path.endswith("__init__.py")
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from the package of this module
        parts = name.split(".")[:len(name.split(".")) - node.level + is_pkg]
        base = ".".join(parts + ([base] if base else []))
      for a in node.names:
        sub = f"{base}.{a.name}"
        out.add(sub if sub in modules else base)
  return {m for m in out if m.split(".")[0] in PACKAGES}


def layer_of(module: str) -> int:
  """Index of the layer owning `module` (longest matching prefix; the `serving` facade
  matches only itself)."""
  best, best_len = None, -1
  for i, names in enumerate(LAYERS):
    for prefix in names:
      exact_only = prefix == "serving"
      if module == prefix or (not exact_only and module.startswith(prefix + ".")):
        if len(prefix) > best_len:
          best, best_len = i, len(prefix)
  if best is None:
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
  return best


def import_graph(root: str) -> dict[str, set[str]]:
  modules = module_files(root)
  return {name: {m for m in imports_of(name, path, modules) if m != name}
          for name, path in modules.items()}


def violations(root: str) -> list[str]:
  """Every upward import and every import cycle under `root`, as messages."""
  graph = import_graph(root)
  problems = []
  for mod, deps in sorted(graph.items()):
    for dep in sorted(deps):
      if layer_of(dep) > layer_of(mod):
        problems.append(f"upward import: {mod} (layer {LAYERS[layer_of(mod)]}) imports "
                        f"{dep} (layer {LAYERS[layer_of(dep)]})")
  problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
  return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def jax_importers(root: str, packages: tuple[str, ...]) -> list[str]:
  """Modules reachable from `packages` (through our imports) that import jax themselves."""
  modules = module_files(root)
  graph = import_graph(root)
  todo = [m for m in graph if any(m == p or m.startswith(p + ".") for p in packages)]
  seen, bad = set(todo), []
  while todo:
    mod = todo.pop()
    with open(modules[mod], encoding="utf-8") as f:
      tree = ast.parse(f.read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    if any(n.split(".")[0] in ("jax", "jaxlib") for n in names):
      bad.append(mod)
    for dep in graph[mod] - seen:
      seen.add(dep)
      todo.append(dep)
  return sorted(bad)


# ---- the repository ----


def test_repository_layers_hold():
  assert violations(REPO) == []


def test_host_side_imports_no_jax():
  assert jax_importers(REPO, NO_JAX) == []


def test_every_module_has_a_docstring():
  missing = []
  for name, path in module_files(REPO).items():
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    if tree.body and ast.get_docstring(tree) is None and "_pb2" not in name:
      missing.append(name)
  assert missing == []


# ---- the checker itself, on small trees ----


def _tree(root, files: dict[str, str]) -> str:
  for rel, text in files.items():
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(textwrap.dedent(text))
  return str(root)


BASE = {
    "serving/__init__.py": '"""facade"""\nfrom serving.types import SamplingParams\n',
    "serving/types.py": '"""vocabulary"""\n',
    "serving/models/__init__.py": '"""models"""\n',
    "serving/models/llama.py": '"""model"""\nimport numpy\n',
    "serving/engine/__init__.py": '"""engine"""\n',
    "serving/engine/scheduler.py": '"""host"""\nfrom serving.types import SamplingParams\n',
    "serving/runner/__init__.py": '"""runner"""\n',
    "serving/runner/steps.py": '"""device"""\nimport jax\nfrom serving.models import llama\n',
}


def test_checker_passes_a_layered_tree(tmp_path):
  root = _tree(tmp_path, BASE)
  assert violations(root) == []
  assert jax_importers(root, NO_JAX) == []


def test_checker_catches_an_upward_import(tmp_path):
  root = _tree(tmp_path, {**BASE, "serving/models/llama.py": '''
      """a model reaching up into the runner, inside a function"""
      def forward():
        from serving.runner import steps
        return steps
      '''})
  found = violations(root)
  assert found[0].startswith("upward import: serving.models.llama (layer ('serving.models',)) "
                             "imports serving.runner.steps"), found


def test_checker_catches_a_cycle(tmp_path):
  root = _tree(tmp_path, {**BASE,
                          "serving/engine/a.py": '"""a"""\nfrom serving.engine import b\n',
                          "serving/engine/b.py": '"""b"""\nfrom . import a\n'})
  assert violations(root) == ["import cycle: serving.engine.a -> serving.engine.b"]


def test_checker_catches_jax_on_the_host_side(tmp_path):
  root = _tree(tmp_path, {**BASE, "serving/engine/scheduler.py": '''
      """host code that pulls in the runner"""
      from serving.runner import steps
      '''})
  assert violations(root) == []  # downward, so allowed as an import...
  assert jax_importers(root, NO_JAX) == ["serving.runner.steps"]  # ...but it reaches jax
