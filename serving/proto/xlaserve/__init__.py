"""Protocol buffer package `xlaserve`."""
