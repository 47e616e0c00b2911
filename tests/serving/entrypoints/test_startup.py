"""Start-up errors that are the input's fault: ports that cannot be bound.

`check_ports_free` (the launcher's early check) and the servers' own binds,
for the race where a port is taken between the two: both raise `BindError`,
never uvicorn's process exit or grpc's RuntimeError, and a second server cannot
share a running server's gRPC port. The command-line side (one line, exit
status 2) is tests/serving/test_launcher_cli.py.
"""

import socket

import pytest
from frontend_fake import InProcessServer
from server_procs import free_port

from serving.entrypoints.startup import BindError, check_ports_free


@pytest.fixture
def busy_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]


def test_check_ports_free(busy_port):
  check_ports_free("127.0.0.1", {"--http_port": free_port(), "--grpc_port": 0, "x": -1})
  with pytest.raises(BindError, match=f"--grpc_port: cannot listen on 127.0.0.1:{busy_port}: "
                                      "the port is already in use"):
    check_ports_free("127.0.0.1", {"--http_port": free_port(), "--grpc_port": busy_port})
  with pytest.raises(BindError, match="cannot listen on no-such-host.invalid"):
    check_ports_free("no-such-host.invalid", {"--http_port": 8000})


@pytest.mark.parametrize("which", ["http_port", "grpc_port"])
def test_servers_raise_bind_error_for_a_port_in_use(busy_port, which):
  other = "grpc_port" if which == "http_port" else "http_port"
  srv = InProcessServer(**{which: busy_port, other: -1})
  with pytest.raises(RuntimeError, match="did not start"):
    srv.__enter__()
  srv.stop()
  assert isinstance(srv.error, BindError), repr(srv.error)
  assert f"127.0.0.1:{busy_port}" in str(srv.error)


def test_a_second_server_cannot_share_the_grpc_port():
  with InProcessServer(http_port=-1) as first:
    port = int(first.grpc.rsplit(":", 1)[1])
    second = InProcessServer(http_port=-1, grpc_port=port)
    with pytest.raises(RuntimeError, match="did not start"):
      second.__enter__()
    second.stop()
    assert isinstance(second.error, BindError), repr(second.error)
