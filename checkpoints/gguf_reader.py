"""A fast, minimal GGUF (v2/v3, little-endian) reader.

`gguf.GGUFReader` builds a numpy view per metadata item, which takes seconds
on a vocabulary of 50k strings plus 50k merges. This reader parses the header
with `struct` (tens of milliseconds) and memory-maps the tensor data. It keeps
the attribute names of `gguf.GGUFReader` tensors (`name`, `tensor_type`,
`shape` in ggml order, `data` as the reader would return it), so
`gguf.quants.dequantize(t.data, t.tensor_type)` works on its tensors.

`metadata_value(reader, key)` reads a value from either reader.

Nothing in the file is trusted: counts are bounded by the bytes left, array
nesting by `MAX_NESTING`, the alignment must be a power of two, every tensor
must lie inside the file with at most `MAX_DIMS` whole-block dimensions, and a
split model's count must match its file name. A bad file is a ValueError
naming what is wrong, never a crash or an out-of-bounds read.
"""

from __future__ import annotations

import dataclasses
import mmap
import re
import struct
from typing import Any

import gguf
import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_SPLIT_RE = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")
MAX_NESTING = 4  # arrays of arrays of ... in metadata
MAX_DIMS = 4  # ggml tensors have at most four dimensions
MAX_ALIGNMENT = 1 << 16
# Plain (non-block) tensor types and their numpy element types.
_PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
          gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
          gguf.GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass
class TensorInfo:
  """One tensor: `shape` in ggml order (fastest axis first), `data` mapped lazily."""

  name: str
  shape: tuple[int, ...]
  tensor_type: gguf.GGMLQuantizationType
  offset: int  # absolute byte offset in the file
  n_bytes: int
  _mm: np.ndarray = dataclasses.field(repr=False)

  @property
  def data(self) -> np.ndarray:
    """Like `gguf.ReaderTensor.data`: typed for plain types, uint8 rows of blocks otherwise."""
    raw = self._mm[self.offset:self.offset + self.n_bytes]
    rows = tuple(reversed(self.shape))
    if self.tensor_type in _PLAIN:
      return raw.view(_PLAIN[self.tensor_type]).reshape(rows)
    return raw.reshape((*rows[:-1], -1))


class GGUFFile:
  """Parsed header (`fields`: key -> python value) and tensor infos of a GGUF file."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    self._pos = 0
    if self._take(4) != GGUF_MAGIC:
      raise ValueError(f"{path} is not a GGUF file (bad magic)")
    self.version = self._scalar("<I")
    if self.version not in (2, 3):
      raise ValueError(f"unsupported GGUF version {self.version} in {path} (supported: 2, 3)")
    n_tensors, n_kv = self._count(8), self._count(8)
    self.fields: dict[str, Any] = {}
    for _ in range(n_kv):
      key = self._string()
      self.fields[key] = self._value(self._scalar("<I"))
    infos = [self._tensor_info() for _ in range(n_tensors)]
    align = self.fields.get("general.alignment", 32)
    if not isinstance(align, int) or not 0 < align <= MAX_ALIGNMENT or align & (align - 1):
      raise ValueError(f"{path}: general.alignment={align!r} is not a power of two up to "
                       f"{MAX_ALIGNMENT}")
    data_start = -(-self._pos // align) * align
    # A plain read-only ndarray over the mapping (np.memmap slices are slow to make).
    self._mm = np.frombuffer(self._buf, dtype=np.uint8)
    self.tensors = [self._make_tensor(name, dims, ttype, data_start + off)
                    for name, dims, ttype, off in infos]

  def _make_tensor(self, name, dims, ttype, offset) -> TensorInfo:
    try:
      qtype = gguf.GGMLQuantizationType(ttype)
    except ValueError:
      raise ValueError(f"unsupported GGUF tensor type id {ttype} for tensor {name!r}") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if len(dims) > MAX_DIMS or any(d < 1 for d in dims) or (dims and dims[0] % block):
      raise ValueError(f"{self.path}: tensor {name!r} has invalid dimensions {dims} for "
                       f"{qtype.name} (blocks of {block})")
    n_elems = 1
    for d in dims:
      n_elems *= d
    n_bytes = n_elems // block * type_size
    if offset + n_bytes > len(self._buf):
      raise ValueError(f"{self.path}: tensor {name!r} ({n_bytes} bytes at offset {offset}) "
                       f"runs past the end of the file ({len(self._buf)} bytes)")
    return TensorInfo(name=name, shape=tuple(dims), tensor_type=qtype, offset=offset,
                      n_bytes=n_bytes, _mm=self._mm)

  def _take(self, n: int) -> bytes:
    if self._pos + n > len(self._buf):
      raise ValueError(f"truncated GGUF file {self.path}")
    out = self._buf[self._pos:self._pos + n]
    self._pos += n
    return out

  def _scalar(self, fmt: str) -> Any:
    (value,) = struct.unpack_from(fmt, self._buf, self._pos)
    self._pos += struct.calcsize(fmt)
    return value

  def _count(self, min_item_bytes: int) -> int:
    """A count read from the file that the bytes left could hold (at least that many bytes
    an item), so that a forged count cannot make a loop run for ever."""
    count = self._scalar("<Q")
    if count * min_item_bytes > len(self._buf) - self._pos:
      raise ValueError(f"{self.path}: a count of {count} items at byte {self._pos} does not "
                       "fit in the file")
    return count

  def _string(self) -> str:
    return self._take(self._scalar("<Q")).decode("utf-8", errors="replace")

  def _value(self, vtype: int, depth: int = 0) -> Any:
    if vtype == _STRING:
      return self._string()
    if vtype == _ARRAY:
      if depth >= MAX_NESTING:
        raise ValueError(f"{self.path}: metadata arrays nest deeper than {MAX_NESTING}")
      item_type = self._scalar("<I")
      if item_type in _NUMPY:
        dt = np.dtype(_NUMPY[item_type]).newbyteorder("<")
        count = self._count(dt.itemsize)
        return np.frombuffer(self._take(count * dt.itemsize), dtype=dt).tolist()
      count = self._count(8 if item_type in (_STRING, _ARRAY) else 1)
      return [self._value(item_type, depth + 1) for _ in range(count)]
    if vtype not in _SCALARS:
      raise ValueError(f"unsupported GGUF metadata value type {vtype} in {self.path}")
    return self._scalar(_SCALARS[vtype])

  def _tensor_info(self) -> tuple[str, list[int], int, int]:
    name = self._string()
    n_dims = self._scalar("<I")
    if n_dims > MAX_DIMS:
      raise ValueError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (at most "
                       f"{MAX_DIMS})")
    dims = [self._scalar("<Q") for _ in range(n_dims)]
    return name, dims, self._scalar("<I"), self._scalar("<Q")


def open_gguf(path: str) -> GGUFFile:
  """Opens a GGUF file; for a split model (`name-00001-of-00003.gguf`, llama.cpp's
  gguf-split) the tensors of every split are gathered into the first's list.
  """
  first = GGUFFile(path)
  count = first.fields.get("split.count", 1)
  if not isinstance(count, int):
    raise ValueError(f"{path}: split.count={count!r} is not an integer")
  if count <= 1:
    return first
  m = _SPLIT_RE.fullmatch(path)
  if m is None or int(m.group(3)) != count:
    raise ValueError(f"{path} says it is one of {count} splits but its name does not end in "
                     f"-NNNNN-of-{count:05d}.gguf")
  paths = [f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
  merged = first if paths[0] == path else GGUFFile(paths[0])
  for other in paths[1:]:
    merged.tensors.extend(GGUFFile(other).tensors)
  want = merged.fields.get("split.tensors.count")
  if want is not None and int(want) != len(merged.tensors):
    raise ValueError(f"split GGUF {paths[0]}: found {len(merged.tensors)} tensors, "
                     f"the header says {want}")
  return merged


def metadata_value(reader: Any, key: str, default: Any = None) -> Any:
  """`key` from a `GGUFFile` or a `gguf.GGUFReader` (default when absent)."""
  value = reader.fields.get(key)
  if value is None:
    return default
  return value.contents() if isinstance(value, gguf.ReaderField) else value

