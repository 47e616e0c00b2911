"""What stops a server or engine from starting because of its input, not because of a bug.

Two exception types, which the `xlaserve` launcher reports as one line on
stderr with exit status 2 (like a bad flag), and the early port check:

- `SetupError` (a ValueError): the model or the engine options cannot be
  served as given: a model that cannot be found or read, a parallel layout
  that needs more devices than are visible, options that do not go together.
  `engine_builder.check_setup` raises it before any weights load.
- `BindError` (an OSError): a port the server was told to listen on cannot
  be bound (in use, no permission, an address this host does not have).
  `check_ports_free` raises it before the engine is built; the servers raise
  it too when the bind itself fails.

Anything else that escapes start-up is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping


class SetupError(ValueError):
  """The model or the engine options cannot be served as given."""


class BindError(OSError):
  """A listening port cannot be bound."""


def bind_error(what: str, host: str, port: int, cause: OSError | str) -> BindError:
  """The BindError of `what` (e.g. "--http_port=8000") on `host:port`."""
  if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
    reason = "the port is already in use"
  else:
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
  return BindError(f"{what}: cannot listen on {host}:{port}: {reason}")


def check_ports_free(host: str, ports: Mapping[str, int]) -> None:
  """Binds (and releases) each port of `ports` (label -> port; <= 0: disabled or any free
  port, not checked) on `host`, as the servers will: BindError on the first that fails."""
  for what, port in ports.items():
    if port <= 0:
      continue
    try:
      infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
      raise bind_error(what, host, port, e.strerror or str(e)) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC do
      try:
        s.bind(address)
      except OSError as e:
        raise bind_error(what, host, port, e) from None
