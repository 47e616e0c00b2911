"""benchmarks/compare_peers.py: a server it would start on a port that already answers is
refused before anything starts (the other server would answer its requests and its row
would carry that server's figures)."""

import argparse
import http.server
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import compare_peers  # noqa: E402 (benchmarks/ is not a package)


@pytest.fixture
def listening_url():
  server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f"http://127.0.0.1:{server.server_address[1]}"
  server.shutdown()
  server.server_close()


def test_port_in_use_sees_a_listening_server(listening_url):
  assert compare_peers.port_in_use(listening_url)
  server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
  free = f"http://127.0.0.1:{server.server_address[1]}"
  server.server_close()
  assert not compare_peers.port_in_use(free)


def test_a_started_server_on_a_busy_port_is_refused(listening_url):
  specs = {"llama-server": {"cmd": ["/bin/false"], "url": listening_url, "extra": {}}}
  with pytest.raises(SystemExit, match="already answers"):
    compare_peers.run_servers(argparse.Namespace(levels="1"), [], specs)
