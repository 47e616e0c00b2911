"""DiskPageStore: page files round-trip every dtype byte for byte; LRU by file bytes; a
corrupt, truncated or foreign file is refused and deleted; a restart finds its pages;
a failed write disables writing with one log line; puts and gets from two threads."""

import builtins
import errno
import hashlib
import logging
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from serving.config import EngineConfig
from serving.engine import kv_disk_store
from serving.engine.kv_disk_store import DiskPageStore, disk_identity

IDENTITY = {"model": "tiny", "page_size": "4", "kv_dtype": "int8", "layout": "k,v"}
OTHER = {**IDENTITY, "model": "other"}
LOGGER = "serving.engine.kv_disk_store"


def h_of(i: int) -> bytes:
  return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def page(i: int, n: int = 256) -> list[np.ndarray]:
  """A page like an int8 pool's: int8 K and V [2 layers, 4 tokens, n // 8 values] and
  their float32 scales; the values depend on `i`."""
  rng = np.random.default_rng(i)
  k = rng.integers(-128, 128, (2, 4, n // 8), dtype=np.int8)
  v = rng.integers(-128, 128, (2, 4, n // 8), dtype=np.int8)
  scales = rng.random((2, 2, 4), dtype=np.float32)
  return [k, v, scales]


def same(a: list[np.ndarray], b: list[np.ndarray] | None) -> bool:
  """Equal dtypes, shapes and bytes (NaN payloads included)."""
  return b is not None and len(a) == len(b) and all(
      x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
      for x, y in zip(a, b, strict=True))


def files(store: DiskPageStore, suffix: str = ".kvp") -> list[str]:
  return sorted(f for f in os.listdir(store.path) if f.endswith(suffix))


def file_of(store: DiskPageStore, h: bytes) -> str:
  return os.path.join(store.path, h.hex() + ".kvp")


def size_of(tmp_path) -> int:
  """The size of `page(0)`'s file (all `page(i)` files have it), written by a scratch store."""
  store = DiskPageStore(str(tmp_path / "scratch"), 1 << 30, IDENTITY)
  assert store.put(h_of(0), page(0))
  store.close()
  return os.path.getsize(file_of(store, h_of(0)))


@pytest.mark.parametrize("dtype", sorted(kv_disk_store._DTYPES))
def test_every_dtype_round_trips_byte_for_byte(tmp_path, dtype):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  dt = np.dtype(kv_disk_store._DTYPES[dtype])
  rng = np.random.default_rng(0)
  raw = rng.integers(0, 256, 3 * 5 * 7 * dt.itemsize, dtype=np.uint8)
  if dt == np.bool_:
    raw = raw % 2
  a = raw.view(dt).reshape(3, 5, 7)
  arrays = [a, a[:, ::2].T, a[0, 0, 0, ...], np.zeros((0, 4), dt)]  # strided, 0-d, empty
  assert store.put(h_of(1), arrays)
  back = store.get(h_of(1))
  assert same([x.copy(order="C") for x in arrays], back)
  assert all(x.flags.writeable for x in back)
  store.close()
  assert same([x.copy(order="C") for x in arrays],
              DiskPageStore(str(tmp_path), 1 << 20, IDENTITY).get(h_of(1)))


def test_quantized_pages_keep_values(tmp_path):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  values = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
  arrays = [values.astype(ml_dtypes.bfloat16), values.astype(ml_dtypes.float8_e4m3fn),
            np.float32([0.5, 2.0])]
  assert store.put(h_of(7), arrays)
  back = store.get(h_of(7))
  np.testing.assert_array_equal(back[0].astype(np.float32), arrays[0].astype(np.float32))
  np.testing.assert_array_equal(back[1].astype(np.float32), arrays[1].astype(np.float32))
  assert back[1].dtype == np.dtype(ml_dtypes.float8_e4m3fn) and back[2].tolist() == [0.5, 2.0]


def test_a_miss_is_counted_and_a_stored_page_is_not_rewritten(tmp_path):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert store.get(h_of(1)) is None and h_of(1) not in store
  assert store.put(h_of(1), page(1)) and store.put(h_of(1), page(1))
  assert h_of(1) in store and len(store) == 1
  stats = store.stats
  assert (stats.hits, stats.misses, stats.writes, stats.files) == (0, 1, 1, 1)
  assert stats.bytes_used == stats.bytes_written == os.path.getsize(file_of(store, h_of(1)))
  store.get(h_of(1))
  assert store.stats.hits == 1 and store.stats.bytes_read == stats.bytes_used


def test_lru_evicts_by_file_bytes_headers_included(tmp_path):
  size = size_of(tmp_path)
  store = DiskPageStore(str(tmp_path), 3 * size + size // 2, IDENTITY)
  for i in range(3):
    assert store.put(h_of(i), page(i))
  assert store.get(h_of(0)) is not None  # 0 becomes the most recently used
  assert store.put(h_of(3), page(3))
  assert store.hashes() == [h_of(2), h_of(0), h_of(3)]
  assert h_of(1) not in store and not os.path.exists(file_of(store, h_of(1)))
  assert store.put(h_of(4), page(4))
  assert store.hashes() == [h_of(0), h_of(3), h_of(4)]
  stats = store.stats
  assert stats.evictions == 2 and stats.files == 3
  on_disk = sum(os.path.getsize(os.path.join(store.path, f)) for f in files(store))
  assert stats.bytes_used == on_disk == 3 * size <= store.capacity_bytes


def test_a_page_larger_than_the_capacity_is_not_stored(tmp_path):
  store = DiskPageStore(str(tmp_path), 1000, IDENTITY)
  assert not store.put(h_of(1), page(1, n=4096))
  assert not store.stats.disabled and files(store) == []
  assert store.put(h_of(2), [np.int8([1, 2])])


@pytest.mark.parametrize("where", ["payload", "header", "checksum"])
def test_a_corrupted_byte_is_refused_and_deleted(tmp_path, caplog, where):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  store.put(h_of(1), page(1))
  path = file_of(store, h_of(1))
  with open(path, "rb") as f:
    data = bytearray(f.read())
  offset = {"payload": len(data) - 100, "header": 40, "checksum": 17}[where]
  data[offset] ^= 0x10
  with open(path, "wb") as f:
    f.write(data)
  with caplog.at_level(logging.WARNING, LOGGER):
    assert store.get(h_of(1)) is None
  assert "refusing" in caplog.text
  assert not os.path.exists(path) and h_of(1) not in store
  stats = store.stats
  assert (stats.refused, stats.misses, stats.hits, stats.files, stats.bytes_used) == (
      1, 1, 0, 0, 0)
  assert store.put(h_of(1), page(1)) and same(page(1), store.get(h_of(1)))


@pytest.mark.parametrize("keep", [10, 40, -1])
def test_a_truncated_file_is_refused_on_get_and_on_restart(tmp_path, keep):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  for i in (1, 2):
    store.put(h_of(i), page(i))
  for i in (1, 2):
    path = file_of(store, h_of(i))
    os.truncate(path, os.path.getsize(path) + keep if keep < 0 else keep)
  assert store.get(h_of(1)) is None and not os.path.exists(file_of(store, h_of(1)))
  store.close()
  restarted = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert restarted.hashes() == [] and restarted.stats.refused == 1
  assert files(restarted) == []


def test_a_file_of_another_identity_is_refused_and_its_own_directory_left_alone(tmp_path):
  other = DiskPageStore(str(tmp_path), 1 << 20, OTHER)
  other.put(h_of(1), page(1))
  other.put(h_of(2), page(2))
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert store.path != other.path and store.hashes() == []
  store.put(h_of(1), page(100))
  # Another model's file under this identity's name: refused on get, deleted.
  os.replace(file_of(other, h_of(1)), file_of(store, h_of(1)))
  assert store.get(h_of(1)) is None and store.stats.refused == 1
  assert not os.path.exists(file_of(store, h_of(1)))
  # ... and on a restart.
  os.link(file_of(other, h_of(2)), file_of(store, h_of(2)))
  store.close()
  restarted = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert restarted.hashes() == [] and restarted.stats.refused == 1
  assert files(other) == [h_of(2).hex() + ".kvp"]  # the other store's own file stays
  assert same(page(2), other.get(h_of(2)))


def test_a_file_under_another_hash_name_is_refused(tmp_path):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  store.put(h_of(1), page(1))
  store.put(h_of(2), page(2))
  os.replace(file_of(store, h_of(1)), file_of(store, h_of(2)))
  assert store.get(h_of(2)) is None and store.stats.refused == 1
  assert store.get(h_of(1)) is None and store.stats.refused == 1  # vanished: only a miss


def test_a_restart_finds_its_pages_in_lru_order(tmp_path):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  for i in range(4):
    store.put(h_of(i), page(i))
  past = os.stat(file_of(store, h_of(0))).st_mtime_ns - 100 * 10**9
  for i in range(4):  # distinct modification times, oldest first, all in the past
    os.utime(file_of(store, h_of(i)), ns=(past + i, past + i))
  assert same(page(1), store.get(h_of(1)))  # a hit makes 1 the newest file
  leftover = os.path.join(store.path, ".tmp-deadbeef-1-2")
  open(leftover, "wb").close()  # a crash mid-write left a temp file
  open(os.path.join(store.path, "notes.txt"), "wb").close()
  store.close()

  restarted = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert restarted.hashes() == [h_of(i) for i in (0, 2, 3, 1)]
  assert all(same(page(i), restarted.get(h_of(i))) for i in range(4))
  assert not os.path.exists(leftover) and os.path.exists(os.path.join(store.path, "notes.txt"))
  assert restarted.stats.bytes_used == 4 * size_of(tmp_path) and restarted.stats.refused == 0
  restarted.close()

  smaller = DiskPageStore(str(tmp_path), 2 * size_of(tmp_path), IDENTITY)
  assert len(smaller.hashes()) == 2 and smaller.stats.evictions == 2
  assert len(files(smaller)) == 2


class _DiskFull:
  """A file whose writes after the first `room` bytes fail with ENOSPC, as on a full disk."""

  def __init__(self, f, room: int):
    self.f, self.room = f, room

  def write(self, data) -> int:
    n = memoryview(data).nbytes
    if n > self.room:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    self.room -= n
    return self.f.write(data)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.f.close()


def test_disk_full_disables_writing_with_one_log_line(tmp_path, caplog, monkeypatch):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  store.put(h_of(1), page(1))

  def full_open(file, mode="r", *args, **kwargs):
    f = builtins.open(file, mode, *args, **kwargs)
    return _DiskFull(f, room=100) if "w" in mode else f

  monkeypatch.setattr(kv_disk_store, "open", full_open, raising=False)
  with caplog.at_level(logging.WARNING, LOGGER):
    assert not store.put(h_of(2), page(2))
    assert not store.put(h_of(3), page(3))
  lines = [r for r in caplog.records if r.name == LOGGER]
  assert len(lines) == 1 and "disabled" in lines[0].getMessage()
  assert "No space left" in lines[0].getMessage()
  stats = store.stats
  assert stats.disabled and stats.writes == 1 and stats.files == 1
  assert files(store, "") == [".lock", h_of(1).hex() + ".kvp"]  # the partial file is gone
  assert same(page(1), store.get(h_of(1)))  # stored pages are still served
  assert h_of(2) not in store and store.get(h_of(2)) is None


def test_a_vanished_directory_disables_writing(tmp_path, caplog):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  os.rename(store.path, store.path + "-moved")
  open(store.path, "wb").close()  # a file where the directory was: every write fails
  with caplog.at_level(logging.WARNING, LOGGER):
    assert not store.put(h_of(1), page(1))
    assert not store.put(h_of(2), page(2))
  assert store.stats.disabled
  assert len([r for r in caplog.records if "disabled" in r.getMessage()]) == 1


@pytest.mark.skipif(os.getuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_directory_disables_writing(tmp_path, caplog):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  os.chmod(store.path, 0o500)
  try:
    with caplog.at_level(logging.WARNING, LOGGER):
      assert not store.put(h_of(1), page(1))
    assert store.stats.disabled and "Permission denied" in caplog.text
  finally:
    os.chmod(store.path, 0o700)


def test_an_unusable_directory_starts_disabled(tmp_path, caplog):
  blocker = tmp_path / "file"
  blocker.write_bytes(b"")
  with caplog.at_level(logging.WARNING, LOGGER):
    store = DiskPageStore(str(blocker / "kv"), 1 << 20, IDENTITY)
  assert store.stats.disabled and "disabled" in caplog.text
  assert not store.put(h_of(1), page(1)) and store.get(h_of(1)) is None


def test_one_store_per_directory_and_identity(tmp_path, caplog):
  first = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  first.put(h_of(1), page(1))
  with caplog.at_level(logging.WARNING, LOGGER):
    second = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert second.stats.disabled and "in use" in caplog.text and second.hashes() == []
  assert files(first) == [h_of(1).hex() + ".kvp"]
  first.close()
  third = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert not third.stats.disabled and same(page(1), third.get(h_of(1)))


def test_a_shared_writable_directory_is_not_trusted(tmp_path):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  store.put(h_of(1), page(1))
  store.close()
  os.chmod(store.path, 0o777)
  untrusted = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  assert untrusted.stats.disabled and untrusted.get(h_of(1)) is None


def test_bad_arguments_are_value_errors(tmp_path):
  store = DiskPageStore(str(tmp_path), 1 << 20, IDENTITY)
  with pytest.raises(ValueError, match="hash"):
    store.put("abc", page(1))
  with pytest.raises(ValueError, match="cannot be stored"):
    store.put(h_of(1), [np.array(["a"], dtype=object)])
  with pytest.raises(ValueError, match="cannot be stored"):
    store.put(h_of(1), [np.arange(3, dtype=">f4")])
  with pytest.raises(ValueError, match="numpy arrays"):
    store.put(h_of(1), [[1, 2]])
  with pytest.raises(ValueError, match="capacity_bytes"):
    DiskPageStore(str(tmp_path), 0, IDENTITY)
  with pytest.raises(ValueError, match="str to str"):
    DiskPageStore(str(tmp_path), 1, {"page_size": 4})
  assert files(store) == [] and not store.stats.disabled


def test_puts_and_gets_from_two_threads(tmp_path):
  """A writer thread (the host tier's offload thread) stores pages while evicting and a
  reader (the engine) gets them: every page read is the one stored under its hash."""
  pages = {h_of(i): page(i, n=1 << 14) for i in range(60)}  # 33,152-byte files
  store = DiskPageStore(str(tmp_path), 12 * 33_152, IDENTITY)
  errors, served = [], []
  done = threading.Event()

  def write(order):
    try:
      for i in order:
        assert store.put(h_of(i), pages[h_of(i)])
    except Exception as e:  # noqa: BLE001 - reported by the main thread
      errors.append(e)

  def read():
    rng = np.random.default_rng(1)
    try:
      while not done.is_set():
        h = h_of(int(rng.integers(60)))
        got = store.get(h)
        if got is not None:
          assert same(pages[h], got)
          served.append(h)
    except Exception as e:  # noqa: BLE001 - reported by the main thread
      errors.append(e)

  writers = [threading.Thread(target=write, args=(order,))
             for order in (range(60), range(59, -1, -1))]  # the same pages, both ends
  reader = threading.Thread(target=read)
  reader.start()
  for t in writers:
    t.start()
  for t in writers:
    t.join()
  done.set()
  reader.join()
  assert errors == [] and served
  stats = store.stats
  on_disk = files(store)
  assert stats.files == len(on_disk) <= 12 and files(store, "") == [".lock"] + on_disk
  assert stats.bytes_used == sum(os.path.getsize(os.path.join(store.path, f)) for f in on_disk)
  assert stats.refused == 0 and stats.hits == len(served)


def test_disk_identity_follows_what_shapes_the_kv():
  config = EngineConfig.of(page_size=16)
  base = dict(model="org/tiny", model_config={"layers": 2, "heads": 4},
              engine_config=config, kv_dtype="int8", layout="k,v[L,T,K,H]")
  identity = disk_identity(**base)
  assert identity == disk_identity(**{**base, "model_config": {"heads": 4, "layers": 2}})
  assert identity["page_size"] == "16" and identity["kv_dtype"] == "int8"
  assert all(isinstance(v, str) for v in identity.values())
  changes = [{"model": "org/other"}, {"model_config": {"layers": 3, "heads": 4}},
             {"engine_config": config.replace(page_size=32)},
             {"engine_config": config.replace(weight_dtype="bfloat16")},
             {"engine_config": config.replace(tp=2)}, {"kv_dtype": "fp8"},
             {"layout": "k,v tp=2 shard 0"}, {"revision": "abc"}]
  for change in changes:
    assert disk_identity(**{**base, **change}) != identity, change
  with pytest.raises(ValueError, match="dataclass or a dict"):
    disk_identity(**{**base, "model_config": "llama"})
