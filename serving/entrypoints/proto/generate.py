"""Regenerates the checked-in gRPC stubs from the .proto files.

Run from anywhere: `python -m serving.entrypoints.proto.generate [--out DIR]`. Paths are
relative to the repository root so that generated imports read
`from serving.entrypoints.proto.xlaserve.v1 import xlaserve_pb2`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[3]
PROTOS = ("serving/entrypoints/proto/xlaserve/v1/xlaserve.proto",)


def generate(out_dir: pathlib.Path) -> None:
  """Writes the stubs of every proto in PROTOS under `out_dir` (mirroring paths)."""
  from grpc_tools import protoc  # build-time dependency (grpcio-tools)

  out_dir.mkdir(parents=True, exist_ok=True)
  for proto in PROTOS:
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(ROOT / proto)]
    if protoc.main(args) != 0:
      raise RuntimeError(f"protoc failed on {proto}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=str(ROOT), help="output root (default: the repo)")
  generate(pathlib.Path(parser.parse_args().out))


if __name__ == "__main__":
  sys.exit(main())
