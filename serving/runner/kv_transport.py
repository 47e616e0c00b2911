"""The device side of cross-process KV transfer: `jax.experimental.transfer` moving
fixed-shape KV chunks between this process's first device and another process's.

serving/engine/kv_transfer.py decides what moves and when (offers, handshake, expiry,
writes into the pool) and holds no jax; it calls a `KVTransport` for the three device
operations: offer a chunk for one pull, connect to a peer, pull a chunk. Every chunk
has the one shape and dtype both ends agreed on in the handshake, so a pull lands in
arrays of a fixed shape and nothing compiles after warm-up.
"""

from __future__ import annotations

import datetime
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class KVTransport:
  """A transfer server on `host` (any free port) for this process's first device, for
  chunks of `chunk_shape` / `kv_dtype` (K and V alike)."""

  def __init__(self, host: str, chunk_shape: tuple[int, ...], kv_dtype: str):
    from jax.experimental import transfer

    self.device = jax.devices()[0]
    self.server = transfer.start_transfer_server(self.device.client, f"{host}:0",
                                                 [f"{host}:0"])
    self.chunk_shape, self.kv_dtype = tuple(chunk_shape), kv_dtype
    spec = jax.ShapeDtypeStruct(self.chunk_shape, jnp.dtype(kv_dtype),
                                sharding=jax.sharding.SingleDeviceSharding(self.device))
    self._spec = (spec, spec)

  def address(self) -> str:
    """Where peers `connect` to."""
    return self.server.address()

  def offer(self, uuid: int, k: Any, v: Any, timeout_s: float) -> int:
    """Offers one exported chunk (device arrays, or a fake runner's host arrays holding
    only its pages) for a single pull under `uuid`, for at most `timeout_s` -> bytes."""
    k, v = self._offerable(k), self._offerable(v)
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    self.server.await_pull(uuid, (k, v), timeout=deadline)
    return k.nbytes + v.nbytes

  def connect(self, address: str) -> Any:
    """A connection to a peer's transfer server."""
    return self.server.connect(address)

  def pull(self, connection: Any, uuid: int) -> tuple[jax.Array, jax.Array]:
    """The chunk a peer offered under `uuid`, on this device (blocks until it is here).
    It does not time out by itself when the peer never offers `uuid`: callers bound it."""
    return jax.block_until_ready(connection.pull(uuid, self._spec))

  def _offerable(self, a: Any) -> jax.Array:
    """The fixed-shape array on this device that a pull expects: a host array padded
    and placed, a mesh's array gathered."""
    if not isinstance(a, jax.Array):
      pad = [(0, 0)] * a.ndim
      pad[1] = (0, self.chunk_shape[1] - a.shape[1])
      return jax.device_put(np.pad(a, pad).astype(jnp.dtype(self.kv_dtype)), self.device)
    if len(a.devices()) == 1:
      return a
    return jax.device_put(a, jax.sharding.SingleDeviceSharding(self.device))
