"""Entry points: the `LLM` API, the HTTP and gRPC servers, batch jobs, metrics.

Requests are validated here and reach the engine (serving/engine/) through
`AsyncEngine` (servers, batch jobs) or `LLM` (notebooks); `engine_builder`
loads a model into a ready engine. The `xlaserve` command is
serving/launcher.py.
"""
