"""Protocol buffer package `xlaserve.v1` (generated stubs live beside the .proto)."""
