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
  donation;
- a warm start may load some executables in the background
  (`load_in_background`): a call that needs one still loading waits for it.

A stored executable is found by a key that fixes everything the program
depends on: the step's name and static options, the avals (shape, dtype,
sharding) of every argument, the jax/jaxlib versions, the backend and its
devices, and a hash of xlaserve's own device-side source. Anything that
changes any of these misses the store and compiles afresh; a file that fails
to load is recompiled and overwritten. A file records how many devices its
program spans and is loaded onto this process's first device only when that
is one: XLA aborts the process, rather than raising, when a program is loaded
onto devices it was not compiled for (and a process that sees 8 devices but
serves on one would otherwise load its programs onto all 8).

The store replaces JAX's persistent cache; the two do not mix. An executable
that JAX's cache deserialized serializes into a file that fails when run
("Function ... not found", XLA:CPU, jax 0.10.2), and JAX decides once per
process whether its cache is used. So the engine turns JAX's cache on only
for sharded runners, and a process where it is on (the test suite's
conftest) loads from the store but never writes to it.

Only single-device runners use a store (`ExecutableStore.for_runner`); a
sharded runner calls its jitted steps directly.

Trust: loading an executable runs its machine code and goes through pickle
(`serialize_executable`), the trust boundary of JAX's own persistent cache.
The store only loads files owned by this user in a directory no one else can
write (`_trusted`); it never reads checkpoints or anything a request names.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

import kernels_cpu

log = logging.getLogger(__name__)

FORMAT = 2  # bump when what a stored file holds changes
# The code traced into the steps: the layers below the engine (the runner imports only
# these and the two vocabulary modules).
_TRACED_SOURCES = ("kernels_pallas", "kernels_cpu", "serving/models", "sharding",
                   "serving/runner", "serving/types.py", "serving/config.py")


@functools.cache
def source_fingerprint() -> str:
  """sha256 of the source traced into the steps (`_TRACED_SOURCES`: Python, and the
  native kernels' C++)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  paths = []
  for source in _TRACED_SOURCES:
    full = os.path.join(root, source)
    if os.path.isfile(full):
      paths.append(full)
    for dirpath, _, filenames in os.walk(full):
      paths += [os.path.join(dirpath, f) for f in filenames if f.endswith((".py", ".cc", ".h"))]
  h = hashlib.sha256()
  for path in sorted(paths):
    h.update(os.path.relpath(path, root).encode())
    with open(path, "rb") as f:
      h.update(f.read())
  return h.hexdigest()


def _platform_fingerprint() -> str:
  devices = jax.devices()
  # Programs call the native kernels only where they are available (kernels_cpu). XLA_FLAGS
  # change how a program is compiled (e.g. the optimisation level): a program compiled under
  # other flags is another program, as in JAX's own compilation cache.
  return (f"jax={jax.__version__} jaxlib={jaxlib.__version__} backend={jax.default_backend()} "
          f"devices={[d.device_kind for d in devices]} native={kernels_cpu.library.isa()} "
          f"native_layers={kernels_cpu.decoder.enabled()} "
          f"native_prefill={kernels_cpu.paged_attention.prefill_enabled()} "
          f"xla_flags={sorted(os.environ.get('XLA_FLAGS', '').split())}")


def _aval_signature(tree: Any) -> str:
  """Tree structure, shapes and dtypes of every leaf, as text (one device: no shardings)."""
  leaves, treedef = jax.tree.flatten(tree)
  return f"{treedef}|" + ";".join(f"{s}" for s in _shape_key(leaves))


def _shape_key(tree: Any) -> tuple:
  """Shapes and dtypes of the leaves (arrays, numpy values or `jax.ShapeDtypeStruct`s)."""
  return tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
               for x in jax.tree.leaves(tree))


def _num_devices(exe: jax.stages.Compiled) -> int:
  """How many devices the program's inputs span."""
  devices = set()
  for sharding in jax.tree.leaves(exe.input_shardings):
    devices |= set(sharding.device_set)
  return len(devices)


def jax_cache_active() -> bool:
  """Whether JAX's persistent compilation cache is on in this process."""
  return bool(jax.config.jax_compilation_cache_dir) and jax.config.jax_enable_compilation_cache


def enable_jax_cache(enabled: bool, cache_dir: str) -> None:
  """Turns JAX's persistent cache on (`cache_dir`), for sharded runners only: a single
  device uses the store, which must not see executables from JAX's cache (module doc)."""
  if enabled and not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _trusted(path: str) -> bool:
  """A stored file is loaded only if this user owns it and its directory, and neither is
  writable by group or others (loading an executable runs its code, as JAX's cache does)."""
  for p in (path, os.path.dirname(path)):
    st = os.stat(p)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
      return False
  return True


class ExecutableStore:
  """A directory of serialized executables (see module doc)."""

  def __init__(self, directory: str):
    self.directory = directory
    self._warned = False
    os.makedirs(directory, mode=0o700, exist_ok=True)

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

  def has(self, name: str, key: str) -> bool:
    return os.path.exists(self._path(name, key))

  def load(self, name: str, key: str) -> jax.stages.Compiled | None:
    path = self._path(name, key)
    if not os.path.exists(path):
      return None
    if not _trusted(path):
      log.warning("ignoring stored executable %s: not owned by this user or writable by "
                  "others (executables are loaded only from files this server wrote)", path)
      return None
    device = jax.devices()[0]  # where a single-device runner's arrays live
    try:
      with open(path, "rb") as f:
        num_devices, payload, in_tree, out_tree = pickle.load(f)
      # Checked before loading: XLA aborts the process on a program for other devices.
      if num_devices != 1:
        raise ValueError(f"it runs on {num_devices} devices, not on one")
      return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                       execution_devices=[device])
    except Exception as e:  # noqa: BLE001 - a bad file is only a cache miss
      log.warning("could not load stored executable %s (%s: %s); recompiling", path,
                  type(e).__name__, e)
      return None

  def save(self, name: str, key: str, compiled: jax.stages.Compiled) -> None:
    if jax_cache_active():
      if not self._warned:
        log.info("executables not stored: JAX's persistent cache is on in this process")
        self._warned = True
      return
    try:
      data = pickle.dumps((_num_devices(compiled), *serialize_executable.serialize(compiled)))
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
    self._loading: dict[tuple, concurrent.futures.Future] = {}  # background loads
    self._lock = threading.Lock()  # try_load runs in several threads at warm-up
    self.loaded = self.compiled = 0  # executables taken from the store / compiled here

  def __call__(self, *args):
    if self.store is None:
      return self.jitted(*args)
    shape_key = _shape_key(args[self.num_fixed:])
    exe = self._compiled.get(shape_key)
    if exe is None:
      loading = self._loading.get(shape_key)
      if loading is not None:  # still loading in the background: wait, do not compile
        loading.result()
      exe = self._compiled.get(shape_key) or self.prepare(*args)
    return exe(*args)

  def is_stored(self, *args) -> bool:
    """Whether the executable for `args` is held or has a file in the store."""
    return (_shape_key(args[self.num_fixed:]) in self._compiled
            or self.store.has(self.name, self.store.key(self.name, self.static, args)))

  def load_in_background(self, pool: concurrent.futures.Executor, *args) -> None:
    """Starts loading the executable for `args` from the store on `pool`; a call that
    needs it first waits for the load (and compiles only if the file fails to load)."""
    self._loading[_shape_key(args[self.num_fixed:])] = pool.submit(self.try_load, *args)

  def wait_loaded(self) -> int:
    """Waits for this step's background loads; returns how many it started."""
    concurrent.futures.wait(list(self._loading.values()))
    return len(self._loading)

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
    with self._lock:
      self._compiled[shape_key] = exe
      self.loaded += 1
    return True

  def prepare(self, *args) -> jax.stages.Compiled:
    """The executable for `args` (arrays or `jax.ShapeDtypeStruct`s): held, loaded from the
    store, or compiled and stored. Runs nothing."""
    shape_key = _shape_key(args[self.num_fixed:])
    if shape_key not in self._compiled and not self.try_load(*args):
      exe = self.jitted.lower(*args).compile()
      self.compiled += 1
      self.store.save(self.name, self.store.key(self.name, self.static, args), exe)
      self._compiled[shape_key] = exe
    return self._compiled[shape_key]

  def num_programs(self) -> int:
    """Distinct executables this step has run (compiled, loaded or jit-cached)."""
    return len(self._compiled) if self.store is not None else self.jitted._cache_size()
