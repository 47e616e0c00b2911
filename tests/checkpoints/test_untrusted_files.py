"""Checkpoint files are untrusted input: forged GGUF headers and HF indexes are refused
with a ValueError naming the problem (no crash, no huge loop, no read outside the file
or the model directory)."""

from __future__ import annotations

import json
import os
import struct

import pytest

from checkpoints import hf
from checkpoints.gguf_reader import GGUFFile, open_gguf

U32, U64, STRING, ARRAY = 4, 10, 8, 9


def _str(s: str) -> bytes:
  b = s.encode()
  return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
  return _str(key) + struct.pack("<I", vtype) + payload


def _gguf(kvs: list[bytes], tensors: list[bytes] = (), n_tensors: int | None = None,
          n_kv: int | None = None, data: bytes = b"") -> bytes:
  head = b"GGUF" + struct.pack("<I", 3)
  head += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                      len(kvs) if n_kv is None else n_kv)
  body = head + b"".join(kvs) + b"".join(tensors)
  return body + b"\0" * (-len(body) % 32) + data


def _tensor(name: str, dims: list[int], ttype: int = 0, offset: int = 0) -> bytes:
  return (_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
          + struct.pack("<IQ", ttype, offset))


def _write(tmp_path, data: bytes, name: str = "m.gguf") -> str:
  path = os.path.join(tmp_path, name)
  with open(path, "wb") as f:
    f.write(data)
  return path


def test_a_well_formed_file_reads(tmp_path):
  path = _write(tmp_path, _gguf([_kv("general.name", STRING, _str("x"))],
                                [_tensor("w", [4, 2])], data=b"\0" * 32))
  f = GGUFFile(path)
  assert f.fields["general.name"] == "x" and f.tensors[0].data.shape == (2, 4)


FORGED = [
    ("alignment 0", _gguf([_kv("general.alignment", U32, struct.pack("<I", 0))]), "alignment"),
    ("alignment 24", _gguf([_kv("general.alignment", U32, struct.pack("<I", 24))]),
     "alignment"),
    ("kv count past the file", _gguf([], n_kv=2**60), "does not fit"),
    ("tensor count past the file", _gguf([], n_tensors=2**40), "does not fit"),
    ("array count past the file",
     _gguf([_kv("a", ARRAY, struct.pack("<IQ", STRING, 2**50))]), "does not fit"),
    ("numeric array past the file",
     _gguf([_kv("a", ARRAY, struct.pack("<IQ", U64, 2**40))]), "does not fit"),
    ("deep nesting",
     _gguf([_kv("a", ARRAY, struct.pack("<IQ", ARRAY, 1) * 6 + struct.pack("<IQ", U32, 0))]),
     "nest"),
    ("tensor past the end", _gguf([], [_tensor("w", [4, 2], offset=1 << 20)], data=b"\0" * 32),
     "past the end"),
    ("too many dimensions", _gguf([], [_tensor("w", [1, 1, 1, 1, 1])]), "dimensions"),
    ("zero dimension", _gguf([], [_tensor("w", [0, 4])], data=b"\0" * 32), "dimensions"),
    ("truncated", _gguf([_kv("general.name", STRING, _str("x"))])[:30],
     "truncated|does not fit"),
]


@pytest.mark.parametrize("name,data,match", FORGED, ids=[c[0] for c in FORGED])
def test_forged_gguf_headers_are_refused(tmp_path, name, data, match):
  with pytest.raises(ValueError, match=match):
    GGUFFile(_write(tmp_path, data))


def test_split_count_must_match_the_file_name(tmp_path):
  split = _kv("split.count", U32, struct.pack("<I", 3))
  with pytest.raises(ValueError, match="of-00003"):
    open_gguf(_write(tmp_path, _gguf([split]), "m-00001-of-00002.gguf"))
  with pytest.raises(ValueError, match="of-00003"):
    open_gguf(_write(tmp_path, _gguf([split]), "m.gguf"))


@pytest.mark.parametrize("shard", ["../model.safetensors", "/etc/passwd", "sub/x.safetensors",
                                   ".."])
def test_hf_index_names_only_files_in_the_model_directory(tmp_path, shard):
  with open(tmp_path / "model.safetensors.index.json", "w", encoding="utf-8") as f:
    json.dump({"weight_map": {"lm_head.weight": shard}}, f)
  with pytest.raises(ValueError, match="not a file name in the model directory"):
    hf.safetensors_files(str(tmp_path))
