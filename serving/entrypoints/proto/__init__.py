"""Versioned gRPC API definitions (`xlaserve/v1/*.proto`) and their generated stubs.

The stubs are checked in; `python -m serving.entrypoints.proto.generate` regenerates them.
"""
