"""Compiled step programs kept on disk, so a warm start neither traces nor lowers.

JAX's persistent compilation cache saves XLA's compile, but every hit still
needs the program traced in Python and lowered to StableHLO first (the cache
key is a hash of it). With unrolled layers that tracing was most of a warm
start (docs/performance.md). `StepProgram` wraps one jitted step instead:

- per input signature (the shapes and dtypes of the arguments that vary
  between calls) it holds one `jax.stages.Compiled`;
- a missing one is loaded from the `ExecutableStore`
  (`jax.experimental.serialize_executable`), or lowered, compiled and saved
  there;
- calls go straight to the compiled executable, with the jitted function's
  donation.

A stored executable is found by a key that fixes everything the program
depends on: the step's name and static options, the avals (shape, dtype,
sharding) of every argument, the jax/jaxlib versions, the backend and its
devices, and a hash of xlaserve's own device-side source. Anything that
changes any of these misses the store and compiles afresh; a file that fails
to load is recompiled and overwritten. Steps compiled for the store bypass
JAX's own persistent cache (see `_without_jax_cache`).

Only single-device runners use a store (`ExecutableStore.for_runner`); a
sharded runner calls its jitted steps directly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a stored file holds changes
_SOURCE_PACKAGES = ("serving", "kernels_pallas", "sharding")  # code traced into the steps


@functools.cache
def source_fingerprint() -> str:
  """sha256 of xlaserve's traced Python source (every .py of the device-side packages)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  h = hashlib.sha256()
  for package in _SOURCE_PACKAGES:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
      dirnames.sort()
      for name in sorted(f for f in filenames if f.endswith(".py")):
        path = os.path.join(dirpath, name)
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
          h.update(f.read())
  return h.hexdigest()


def _platform_fingerprint() -> str:
  devices = jax.devices()
  return (f"jax={jax.__version__} jaxlib={jaxlib.__version__} backend={jax.default_backend()} "
          f"devices={[d.device_kind for d in devices]}")


def _aval_signature(tree: Any) -> str:
  """Tree structure, shapes and dtypes of every leaf, as text (one device: no shardings)."""
  leaves, treedef = jax.tree.flatten(tree)
  return f"{treedef}|" + ";".join(f"{s}" for s in _shape_key(leaves))


def _shape_key(tree: Any) -> tuple:
  """Shapes and dtypes of the leaves (arrays, numpy values or `jax.ShapeDtypeStruct`s)."""
  return tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
               for x in jax.tree.leaves(tree))


@contextlib.contextmanager
def _without_jax_cache():
  """JAX's persistent cache off for one compile: an executable that JAX's cache
  deserialized serializes into a file that fails at run time ("Function ... not
  found", XLA:CPU, jax 0.10.2), so the store only takes fresh compiles. The store
  stands in for JAX's cache for these programs anyway."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", before)


class ExecutableStore:
  """A directory of serialized executables (see module doc)."""

  def __init__(self, directory: str):
    self.directory = directory
    os.makedirs(directory, exist_ok=True)

  @classmethod
  def for_runner(cls, enabled: bool, cache_dir: str, sharded: bool) -> ExecutableStore | None:
    """The store under the compilation cache dir, or None (cache off, or a sharded runner)."""
    if not enabled or sharded:
      return None
    try:
      return cls(os.path.join(cache_dir, "executables"))
    except OSError as e:
      log.warning("executable store disabled: cannot create it under %s (%s)", cache_dir, e)
      return None

  def key(self, name: str, static: str, args: Sequence[Any]) -> str:
    text = "\n".join([f"format={FORMAT}", name, static, _platform_fingerprint(),
                      source_fingerprint(), _aval_signature(tuple(args))])
    return hashlib.sha256(text.encode()).hexdigest()[:32]

  def _path(self, name: str, key: str) -> str:
    return os.path.join(self.directory, f"{name}-{key}.jaxexe")

  def load(self, name: str, key: str) -> jax.stages.Compiled | None:
    path = self._path(name, key)
    if not os.path.exists(path):
      return None
    try:
      with open(path, "rb") as f:
        payload, in_tree, out_tree = pickle.load(f)
      return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:  # noqa: BLE001 - a bad file is only a cache miss
      log.warning("could not load stored executable %s (%s: %s); recompiling", path,
                  type(e).__name__, e)
      return None

  def save(self, name: str, key: str, compiled: jax.stages.Compiled) -> None:
    try:
      data = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception as e:  # noqa: BLE001 - some executables cannot be serialized
      log.warning("executable %s not stored (%s: %s)", name, type(e).__name__, e)
      return
    fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, self._path(name, key))  # atomic: readers never see half a file


class StepProgram:
  """One jitted step, called through compiled executables kept in a store.

  `num_fixed` leading arguments (weights, device state) keep their avals for
  the runner's lifetime, so only the rest select the executable in memory.
  Without a store it is the jitted function itself.
  """

  def __init__(self, name: str, jitted: Callable, *, static: str, num_fixed: int,
               store: ExecutableStore | None):
    self.name, self.jitted, self.static = name, jitted, static
    self.num_fixed, self.store = num_fixed, store
    self._compiled: dict[tuple, jax.stages.Compiled] = {}
    self.loaded = self.compiled = 0  # executables taken from the store / compiled here

  def __call__(self, *args):
    if self.store is None:
      return self.jitted(*args)
    exe = self._compiled.get(_shape_key(args[self.num_fixed:]))
    if exe is None:
      exe = self.prepare(*args)
    return exe(*args)

  def try_load(self, *args) -> bool:
    """Loads the executable for `args` from the store if it is there; never compiles.

    Safe to call from several threads at once (loading releases the GIL).
    """
    shape_key = _shape_key(args[self.num_fixed:])
    if shape_key in self._compiled:
      return True
    exe = self.store.load(self.name, self.store.key(self.name, self.static, args))
    if exe is None:
      return False
    self._compiled[shape_key] = exe
    self.loaded += 1
    return True

  def prepare(self, *args) -> jax.stages.Compiled:
    """The executable for `args` (arrays or `jax.ShapeDtypeStruct`s): held, loaded from the
    store, or compiled and stored. Runs nothing."""
    shape_key = _shape_key(args[self.num_fixed:])
    if shape_key not in self._compiled and not self.try_load(*args):
      with _without_jax_cache():
        exe = self.jitted.lower(*args).compile()
      self.compiled += 1
      self.store.save(self.name, self.store.key(self.name, self.static, args), exe)
      self._compiled[shape_key] = exe
    return self._compiled[shape_key]

  def num_programs(self) -> int:
    """Distinct executables this step has run (compiled, loaded or jit-cached)."""
    return len(self._compiled) if self.store is not None else self.jitted._cache_size()
