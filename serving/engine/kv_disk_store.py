"""The disk tier of the prefix cache: one file per KV page, keyed by its prefix hash.

The host tier (docs/kv_offload.md) hands a page here when it evicts it and asks for it
back on a prefix hit that missed the device pool and host memory. A page is the list of
numpy arrays the host tier holds for it (K and V, int8/fp8 data with their scales, one
entry per tp shard: whatever it stores), kept byte for byte with dtypes and shapes.

Where files live. `directory/<identity digest>/<prefix hash hex>.kvp`: the identity
(`disk_identity`: model, config digest, page size, KV dtype, layout) picks a
subdirectory, so servers of different models may share one `directory` and leave each
other's files alone. A store holds an exclusive lock on its subdirectory (`.lock`); a
second store of the same identity on the same directory, in this process or another,
finds it taken and starts disabled.

A file (little-endian, the format `FORMAT_VERSION`):

  magic "XLSKVPG\\0" | u32 version | u32 header bytes N | u32 checksum
  | N bytes of JSON header, space-padded to a 64-byte boundary
  | payload: each array's bytes (C order), each padded with zeros to 64 bytes

The header holds the page's prefix hash, the identity and each array's dtype name and
shape; the checksum is the CRC-32 (zlib) of everything after it (header and payload):
it catches torn writes and flipped bits at several GiB/s, where blake2b managed a tenth
of that on one core. It is no defence against someone who can write the directory (they
could write a matching checksum as easily); only this user may (`_open_directory`). A file
whose magic, version, checksum, identity, hash or size does not match is refused: never
loaded, deleted, counted in `stats.refused`.

Lifecycle:
  1. `DiskPageStore(...)` creates and locks its subdirectory, removes temp files a crash
     left, reads every page file's header (not its payload) and indexes the valid ones,
     oldest modification first: a restart finds its warm cache (`hashes()`). Files of
     another identity or format there are deleted; over capacity, the oldest go.
  2. `put` writes a page to a temp file and renames it into place (atomic: a reader sees
     the whole file or none), first evicting least recently used files until the new
     one fits in `capacity_bytes` (file sizes, headers included).
  3. `get` reads and verifies a page: the arrays, or None on a miss or a refused file.
     A hit refreshes the file's modification time, so the LRU order survives a restart.
  4. An OSError while writing (ENOSPC, EACCES, EROFS, EIO...) disables writing for the
     life of the store: one log line, `stats.disabled`; `put` returns False from then on
     and already stored pages are still served. Nothing here raises an OSError to the
     caller; bad arguments (a hash that is not bytes, an object array) are ValueErrors.

Threads: every method may be called from any thread; one lock guards the index and the
counters, and file reads and writes run outside it. `put` does its I/O synchronously, so
the host tier calls it from its offload thread; `get` reads one file (a page's bytes)
and is best called off the engine thread too. No fsync: a file torn by a power loss
fails its checksum and is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import logging
import os
import struct
import threading
import zlib
from typing import Any

import ml_dtypes
import numpy as np

from serving.config import EngineConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the file layout or header fields change
MAGIC = b"XLSKVPG\0"
_PREFIX = struct.Struct("<8sIII")  # magic, version, header bytes, checksum
_ALIGN = 64
_SUFFIX = ".kvp"
_TMP = ".tmp-"
_MAX_HEADER = 1 << 20
# dtypes a page may hold: numpy's numeric types and ml_dtypes' (bfloat16, float8_*, int4).
_NUMPY_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                 "uint64", "float16", "float32", "float64", "complex64", "complex128")


def _is_scalar_type(value: Any) -> bool:
  return isinstance(value, type) and issubclass(value, np.generic)


_DTYPES = {**{n: np.dtype(n) for n in _NUMPY_DTYPES},
           **{n: np.dtype(getattr(ml_dtypes, n)) for n in ml_dtypes.__all__
              if _is_scalar_type(getattr(ml_dtypes, n))}}


def disk_identity(*, model: str, model_config: Any, engine_config: EngineConfig,
                  kv_dtype: str, layout: str, revision: str = "") -> dict[str, str]:
  """What a stored page must match to be reused, as `DiskPageStore`'s `identity`.

  model: the checkpoint's name or path as served. model_config: the architecture (a
  dataclass such as `ModelConfig`, or a mapping), kept as a digest. kv_dtype: the dtype
  the KV pool stores (resolved, not "auto"). layout: how a page's arrays are laid out,
  e.g. "k,v[layers,page,kv_heads,head_dim] tp=2" (anything that changes the arrays a page
  is made of). revision: anything else that changes the KV of the same tokens, e.g. a
  checkpoint revision or a fingerprint of the model code. The engine options that shape
  the KV (page size, compute/weight dtypes, quantization, tp) are taken from
  `engine_config`.
  """
  model_opts, cache = engine_config.model, engine_config.cache
  return {
      "model": model, "model_config": _digest(_canonical(model_config)),
      "page_size": str(cache.page_size), "kv_dtype": kv_dtype, "layout": layout,
      "dtype": model_opts.dtype, "weight_dtype": model_opts.weight_dtype,
      "quantization": str(model_opts.quantization), "tp": str(engine_config.parallel.tp),
      "revision": revision,
  }


def _canonical(value: Any) -> str:
  """Deterministic text for a dataclass or a mapping (sorted keys, nested values too)."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    value = dataclasses.asdict(value)
  if not isinstance(value, dict):
    raise ValueError(f"model_config must be a dataclass or a dict, not {type(value).__name__}")
  return json.dumps(value, sort_keys=True, default=repr)


def _digest(text: str) -> str:
  return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclasses.dataclass
class DiskStoreStats:
  """The disk tier's counters (a snapshot: `DiskPageStore.stats`)."""

  hits: int = 0  # gets served
  misses: int = 0  # gets not served (absent, vanished or refused)
  refused: int = 0  # files refused and deleted: corrupt, truncated, unreadable, foreign
  writes: int = 0  # pages written
  evictions: int = 0  # files deleted to make room
  bytes_written: int = 0
  bytes_read: int = 0
  bytes_used: int = 0  # the indexed files' sizes (occupancy, headers included)
  files: int = 0  # indexed files
  disabled: bool = False  # writing is off (an OSError, a locked or untrusted directory)


class CorruptPage(ValueError):
  """A page file that must not be loaded (the reason is the message)."""


@dataclasses.dataclass
class _Entry:
  size: int  # file bytes
  gen: int  # which write of this hash (a refusal deletes only the file it read)


class DiskPageStore:
  """KV pages as checksummed files under `directory`, LRU within `capacity_bytes`
  (module doc). `identity`: `disk_identity(...)`, str -> str."""

  def __init__(self, directory: str, capacity_bytes: int, identity: dict[str, str]):
    if capacity_bytes <= 0:
      raise ValueError(f"capacity_bytes={capacity_bytes} must be positive")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in identity.items()):
      raise ValueError(f"identity must map str to str: {identity!r}")
    self.capacity_bytes = capacity_bytes
    self.identity = dict(identity)
    self.path = os.path.join(directory, _digest(json.dumps(self.identity, sort_keys=True)))
    self._lock = threading.Lock()
    self._index: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
    self._gens = itertools.count()
    self._used = 0  # bytes of the indexed files
    self._reserved = 0  # bytes of writes in flight
    self._stats = DiskStoreStats()
    self._lock_file: int | None = None
    reason = self._open_directory()
    if reason:
      self._disable(reason)
    else:
      self._load_index()

  # -- public interface --------------------------------------------------------------

  def put(self, h: bytes, arrays: list[np.ndarray]) -> bool:
    """Stores page `h` (its arrays as given). True when it is stored (or already was);
    False when writing is disabled, the page exceeds the capacity, or the write failed
    (which disables writing)."""
    _check_page(h, arrays)
    with self._lock:
      if h in self._index:
        self._index.move_to_end(h)
        return True
      if self._stats.disabled:
        return False
    header, checksum, size = _encode(h, self.identity, arrays)
    if not self._reserve(h, size):
      return h in self
    tmp = os.path.join(self.path, f"{_TMP}{h.hex()}-{os.getpid()}-{next(self._gens)}")
    try:
      _write(tmp, header, checksum, arrays)
    except OSError as e:
      self._release(size)
      _remove(tmp)
      self._disable(f"writing {tmp} failed: {e}")
      return False
    return self._commit(h, tmp, size)

  def get(self, h: bytes) -> list[np.ndarray] | None:
    """Page `h`'s arrays (writable, dtypes and shapes as stored), or None: not stored,
    its file vanished, or it was refused (deleted and counted)."""
    with self._lock:
      entry = self._index.get(h)
      if entry is None:
        self._stats.misses += 1
        return None
      self._index.move_to_end(h)
    path = self._file(h)
    try:
      arrays = self._read(path, h)
    except (OSError, CorruptPage) as e:
      self._drop(h, entry.gen, e)
      return None
    with self._lock:
      self._stats.hits += 1
      self._stats.bytes_read += entry.size
    _touch(path)
    return arrays

  def __contains__(self, h: bytes) -> bool:
    with self._lock:
      return h in self._index

  def __len__(self) -> int:
    with self._lock:
      return len(self._index)

  def hashes(self) -> list[bytes]:
    """The stored pages' hashes, least recently used first (after a restart: what the
    directory held for this identity)."""
    with self._lock:
      return list(self._index)

  @property
  def stats(self) -> DiskStoreStats:
    """A snapshot of the counters."""
    with self._lock:
      return dataclasses.replace(self._stats, bytes_used=self._used, files=len(self._index))

  def close(self) -> None:
    """Releases the directory lock (the files stay for the next store)."""
    with self._lock:
      if self._lock_file is not None:
        os.close(self._lock_file)
        self._lock_file = None

  # -- the directory -----------------------------------------------------------------

  def _open_directory(self) -> str | None:
    """Creates, checks and locks the identity subdirectory; the reason it cannot be
    used, or None."""
    try:
      os.makedirs(self.path, mode=0o700, exist_ok=True)
      st = os.stat(self.path)
      if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"{self.path} is not owned by this user or is writable by others"
      fd = os.open(os.path.join(self.path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
      return f"cannot use {self.path}: {e}"
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      return f"{self.path} is in use by another store ({e})"
    self._lock_file = fd
    return None

  def _load_index(self) -> None:
    """Indexes the subdirectory's valid page files, oldest first (module doc, step 1)."""
    found, refused = [], 0
    for name in os.listdir(self.path):
      path = os.path.join(self.path, name)
      if name.startswith(_TMP):
        _remove(path)
      elif name.endswith(_SUFFIX):
        try:
          h = bytes.fromhex(name[:-len(_SUFFIX)])
          st = os.stat(path)
          self._check_file(path, h, st.st_size)
          found.append((st.st_mtime_ns, h, st.st_size))
        except (ValueError, OSError) as e:
          log.warning("disk KV tier: refusing %s (%s)", path, e)
          refused += 1
          _remove(path)
    with self._lock:
      for _, h, size in sorted(found):
        self._index[h] = _Entry(size, next(self._gens))
        self._used += size
      self._stats.refused += refused
      self._evict(0)
    log.info("disk KV tier: %d pages (%.1f MiB of %.1f MiB) indexed in %s; %d files refused",
             len(self._index), self._used / 2**20, self.capacity_bytes / 2**20, self.path,
             refused)

  def _file(self, h: bytes) -> str:
    return os.path.join(self.path, h.hex() + _SUFFIX)

  # -- writing -----------------------------------------------------------------------

  def _reserve(self, h: bytes, size: int) -> bool:
    """Makes room for a new file of `size` bytes; False if `h` is already stored, writing
    is disabled or the page cannot fit."""
    with self._lock:
      if h in self._index:
        self._index.move_to_end(h)
        return False
      if self._stats.disabled or size > self.capacity_bytes:
        return False
      self._evict(size)
      self._reserved += size
      return True

  def _release(self, size: int) -> None:
    with self._lock:
      self._reserved -= size

  def _commit(self, h: bytes, tmp: str, size: int) -> bool:
    """Renames a written temp file into place and indexes it."""
    with self._lock:
      self._reserved -= size
      if h in self._index:  # another thread stored it meanwhile
        _remove(tmp)
        return True
      try:
        os.replace(tmp, self._file(h))
      except OSError as e:
        _remove(tmp)
        self._disable_locked(f"renaming {tmp} failed: {e}")
        return False
      self._index[h] = _Entry(size, next(self._gens))
      self._used += size
      self._stats.writes += 1
      self._stats.bytes_written += size
      return True

  def _evict(self, incoming: int) -> None:
    """Deletes least recently used files until `incoming` more bytes fit (lock held)."""
    while self._index and self._used + self._reserved + incoming > self.capacity_bytes:
      h, entry = self._index.popitem(last=False)
      self._used -= entry.size
      self._stats.evictions += 1
      try:
        os.unlink(self._file(h))
      except FileNotFoundError:
        pass  # deleted by hand: already gone
      except OSError as e:
        self._disable_locked(f"deleting {self._file(h)} failed: {e}")

  def _disable(self, reason: str) -> None:
    with self._lock:
      self._disable_locked(reason)

  def _disable_locked(self, reason: str) -> None:
    if not self._stats.disabled:
      self._stats.disabled = True
      log.warning("disk KV tier disabled: %s", reason)

  # -- reading -----------------------------------------------------------------------

  def _read(self, path: str, h: bytes) -> list[np.ndarray]:
    """The verified arrays of page file `path`; CorruptPage says why it is refused."""
    with open(path, "rb") as f:
      size = os.fstat(f.fileno()).st_size
      buf = bytearray(size)
      if f.readinto(buf) != size:
        raise CorruptPage(f"{path} changed size while read")
    specs, offset = self._check_header(memoryview(buf), h, size)
    if zlib.crc32(memoryview(buf)[_PREFIX.size:]) != _PREFIX.unpack_from(buf)[3]:
      raise CorruptPage("checksum mismatch")
    arrays = []
    for dtype, shape in specs:
      count = int(np.prod(shape, dtype=np.int64))
      arrays.append(np.frombuffer(buf, dtype, count, offset).reshape(shape))
      offset += _padded(count * dtype.itemsize)
    return arrays

  def _check_file(self, path: str, h: bytes, size: int) -> None:
    """Checks a file's header (not its checksum) without reading its payload."""
    with open(path, "rb") as f:
      self._check_header(f.read(_PREFIX.size + _MAX_HEADER), h, size)

  def _check_header(self, head: bytes | memoryview, h: bytes, size: int
                    ) -> tuple[list[tuple[np.dtype, tuple[int, ...]]], int]:
    """(dtype, shape) per array and the payload's offset, from a file's first bytes;
    CorruptPage unless the magic, version, identity, hash and file size all match."""
    if len(head) < _PREFIX.size:
      raise CorruptPage(f"truncated: {len(head)} bytes")
    magic, version, header_len, _ = _PREFIX.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION:
      raise CorruptPage(f"not a version-{FORMAT_VERSION} page file ({magic!r}, {version})")
    if header_len > _MAX_HEADER or len(head) < _PREFIX.size + header_len:
      raise CorruptPage(f"truncated header ({header_len} bytes)")
    try:
      header = json.loads(bytes(head[_PREFIX.size:_PREFIX.size + header_len]))
      specs = [(_DTYPES[a["dtype"]], tuple(int(d) for d in a["shape"]))
               for a in header["arrays"]]
      stored_hash, identity = header["hash"], header["identity"]
    except (ValueError, KeyError, TypeError) as e:
      raise CorruptPage(f"bad header: {e!r}") from e
    if identity != self.identity:
      raise CorruptPage(f"another identity: {identity}")
    if stored_hash != h.hex():
      raise CorruptPage(f"holds page {stored_hash}, not {h.hex()}")
    offset = _PREFIX.size + header_len
    expected = offset + sum(_padded(int(np.prod(s, dtype=np.int64)) * d.itemsize)
                            for d, s in specs)
    if size != expected:
      raise CorruptPage(f"{size} bytes where the header describes {expected}")
    return specs, offset

  def _drop(self, h: bytes, gen: int, error: Exception) -> None:
    """Forgets page `h` after a failed read: a refused file is deleted and counted, a
    vanished one only forgotten (unless a newer write replaced it meanwhile)."""
    missing = isinstance(error, FileNotFoundError)
    if not missing:
      log.warning("disk KV tier: refusing page %s (%s)", h.hex(), error)
    with self._lock:
      self._stats.misses += 1
      entry = self._index.get(h)
      if entry is None or entry.gen != gen:
        return
      del self._index[h]
      self._used -= entry.size
      if not missing:
        self._stats.refused += 1
        _remove(self._file(h))


# -- encoding ------------------------------------------------------------------------


def _padded(n: int) -> int:
  return -(-n // _ALIGN) * _ALIGN


def _check_page(h: bytes, arrays: list[np.ndarray]) -> None:
  """ValueError unless `h` is a hash (non-empty bytes) and `arrays` storable arrays."""
  if not isinstance(h, bytes) or not h:
    raise ValueError(f"a page hash is non-empty bytes, not {h!r}")
  for a in arrays:
    if not isinstance(a, np.ndarray):
      raise ValueError(f"a page holds numpy arrays, not {type(a).__name__}")
    if _DTYPES.get(a.dtype.name) != a.dtype or not a.dtype.isnative:
      raise ValueError(f"dtype {a.dtype.str} ({a.dtype.name}) cannot be stored in a page file")


def _encode(h: bytes, identity: dict[str, str], arrays: list[np.ndarray]
            ) -> tuple[bytes, bytes, int]:
  """(padded JSON header, CRC-32, file size) of a page file holding `arrays`."""
  header = json.dumps({"hash": h.hex(), "identity": identity, "arrays": [
      {"dtype": a.dtype.name, "shape": list(a.shape)} for a in arrays]}).encode()
  header += b" " * (_padded(_PREFIX.size + len(header)) - _PREFIX.size - len(header))
  checksum = zlib.crc32(header)
  for a in arrays:
    data = _bytes_of(a)
    checksum = zlib.crc32(bytes(_padded(data.nbytes) - data.nbytes), zlib.crc32(data, checksum))
  size = _PREFIX.size + len(header) + sum(_padded(a.nbytes) for a in arrays)
  return header, checksum, size


def _bytes_of(a: np.ndarray) -> np.ndarray:
  """The array's bytes in C order, as a flat uint8 array (no copy when contiguous)."""
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _write(path: str, header: bytes, checksum: int, arrays: list[np.ndarray]) -> None:
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with open(fd, "wb") as f:
    f.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), checksum))
    f.write(header)
    for a in arrays:
      data = _bytes_of(a)
      f.write(data)
      f.write(bytes(_padded(data.nbytes) - data.nbytes))


def _remove(path: str) -> None:
  """Deletes a file if it can: a file left behind is found again (and refused, for a
  temp file or a refused page) by the next store on this directory."""
  try:
    os.unlink(path)
  except OSError as e:
    if e.errno != errno.ENOENT:
      log.debug("could not delete %s: %s", path, e)


def _touch(path: str) -> None:
  """Marks a file recently used (its mtime orders the index after a restart)."""
  try:
    os.utime(path)
  except OSError as e:
    log.debug("could not touch %s: %s", path, e)
