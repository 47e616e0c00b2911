"""Reference prefill / decode proxy (vLLM's P/D proxy contract), for docs and tests.

    python -m serving.tools.pd_proxy --port=8000 \\
        --prefill=http://127.0.0.1:8100 --decode=http://127.0.0.1:8200,http://127.0.0.1:8300

Each POST /v1/completions or /v1/chat/completions runs in two legs:
  1. a copy of the request goes to the next prefill server (round robin) with
     `kv_transfer_params: {"do_remote_decode": true}`, `max_tokens: 1` and
     `stream: false`; its response's `kv_transfer_params` say where the KV is;
  2. the original request plus those `kv_transfer_params` goes to the next
     decode server (round robin), and its response (JSON or server-sent
     events) is passed back as it arrives.
If the prefill leg fails (server down, an error status), the decode server gets
the request without params and prefills it itself. GET /health answers 200
while the proxy runs; other GETs (/v1/models) go to a decode server.

Standard library only (a thread per connection): a reference, not a load balancer.
"""

from __future__ import annotations

import argparse
import copy
import http.client
import http.server
import itertools
import json
import logging
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)
LEGS = ("/v1/completions", "/v1/chat/completions")


class RoundRobin:
  """The next of a fixed list of base URLs, thread-safe."""

  def __init__(self, urls: Sequence[str]):
    if not urls:
      raise ValueError("a round robin needs at least one URL")
    self.urls = [urllib.parse.urlsplit(u.rstrip("/")) for u in urls]
    self._next = itertools.cycle(range(len(self.urls)))
    self._lock = threading.Lock()

  def pick(self) -> urllib.parse.SplitResult:
    with self._lock:
      return self.urls[next(self._next)]


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
  """The prefill leg's request: one token, not streamed, asking for remote decode."""
  leg = copy.deepcopy(body)
  leg.update(kv_transfer_params={"do_remote_decode": True}, max_tokens=1, stream=False)
  if "max_completion_tokens" in leg:
    leg["max_completion_tokens"] = 1
  leg.pop("stream_options", None)
  return leg


def _connect(url: urllib.parse.SplitResult, timeout_s: float) -> http.client.HTTPConnection:
  return http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout_s)


class PDProxy:
  """The two legs over `prefill` and `decode` base URLs (module doc)."""

  def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0):
    self.prefill, self.decode, self.timeout_s = RoundRobin(prefill), RoundRobin(decode), timeout_s
    self.prefill_failures = 0

  def kv_params(self, path: str, body: dict[str, Any],
                headers: dict[str, str]) -> dict[str, Any] | None:
    """Runs the prefill leg -> the kv_transfer_params to decode with (None if it failed)."""
    url = self.prefill.pick()
    conn = _connect(url, self.timeout_s)
    try:
      conn.request("POST", path, json.dumps(prefill_body(body)), headers)
      resp = conn.getresponse()
      data = resp.read()
      if resp.status != 200:
        raise OSError(f"HTTP {resp.status}: {data[:200]!r}")
      return json.loads(data).get("kv_transfer_params")
    except (OSError, ValueError, http.client.HTTPException) as e:
      log.warning("prefill leg on %s failed (%s): the decode server prefills", url.netloc, e)
      self.prefill_failures += 1
      return None
    finally:
      conn.close()

  def decode_leg(self, method: str, path: str, body: bytes | None,
                 headers: dict[str, str]) -> tuple[http.client.HTTPConnection,
                                                   http.client.HTTPResponse]:
    """Sends the decode leg (or any other request) to the next decode server."""
    conn = _connect(self.decode.pick(), self.timeout_s)
    conn.request(method, path, body, headers)
    return conn, conn.getresponse()


class _Handler(http.server.BaseHTTPRequestHandler):
  proxy: PDProxy  # set on the subclass `serve` makes
  protocol_version = "HTTP/1.1"

  def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the base's name
    log.debug(format, *args)

  def do_GET(self) -> None:  # noqa: N802 -- http.server's name
    if self.path == "/health":
      self._reply(200, b'{"status": "ok"}')
      return
    self._forward("GET", None)

  def do_POST(self) -> None:  # noqa: N802
    raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
    if self.path not in LEGS:
      self._forward("POST", raw)
      return
    try:
      body = json.loads(raw)
      if not isinstance(body, dict):
        raise ValueError("not an object")
    except ValueError:
      self._reply(400, b'{"error": {"message": "the body is not a JSON object"}}')
      return
    params = self.proxy.kv_params(self.path, body, self._headers())
    if params is not None:
      body["kv_transfer_params"] = params
    self._forward("POST", json.dumps(body).encode())

  def _headers(self) -> dict[str, str]:
    out = {"Content-Type": "application/json"}
    if self.headers.get("Authorization"):
      out["Authorization"] = self.headers["Authorization"]
    return out

  def _forward(self, method: str, body: bytes | None) -> None:
    """The decode server's response, streamed back as it arrives (until it closes)."""
    try:
      conn, resp = self.proxy.decode_leg(method, self.path, body, self._headers())
    except (OSError, http.client.HTTPException) as e:
      self._reply(502, json.dumps({"error": {"message": f"decode server: {e}"}}).encode())
      return
    try:
      self.send_response(resp.status)
      self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
      self.send_header("Connection", "close")
      self.end_headers()
      self.close_connection = True
      while data := resp.read1(65536):
        self.wfile.write(data)
        self.wfile.flush()
    finally:
      conn.close()

  def _reply(self, status: int, data: bytes) -> None:
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)


def make_server(proxy: PDProxy, host: str, port: int) -> http.server.ThreadingHTTPServer:
  """The proxy's HTTP server (call `serve_forever`; port 0 picks a free one)."""
  handler = type("PDProxyHandler", (_Handler,), {"proxy": proxy})
  server_cls = type("PDProxyServer", (http.server.ThreadingHTTPServer,),
                    {"request_queue_size": 1024})  # socketserver's default backlog is 5
  server = server_cls((host, port), handler)
  server.daemon_threads = True
  return server


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: --prefill URLS --decode URLS [--host --port]."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prefill", required=True, help="comma-separated prefill server URLs")
  parser.add_argument("--decode", required=True, help="comma-separated decode server URLs")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--timeout_s", type=float, default=600.0)
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.INFO)
  proxy = PDProxy(args.prefill.split(","), args.decode.split(","), args.timeout_s)
  server = make_server(proxy, args.host, args.port)
  print(f"pd_proxy ready: port={server.server_address[1]}", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
