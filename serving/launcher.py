"""`xlaserve` command line (absl): serve | generate | batch | convert | bench.

    xlaserve serve    --model=smollm2-135m-instruct --http_port=8000 --grpc_port=9000
    xlaserve generate --prompt="Hello" --max_tokens=32
    xlaserve batch    --input=in.jsonl --output=out.jsonl
    xlaserve convert  --model=... --output=DIR
    xlaserve bench    ...            (flags and behaviour owned by serving.tools.bench)

The flags live in serving/entrypoints/flags.py; `main()` turns them into frozen
configs (`EngineConfig`, `ServeConfig`, `BatchConfig`) that are passed down.
`run(build_engine=...)` takes the function that makes the engine from the model
name and the `EngineConfig` (default: load the checkpoint); tests pass one that
builds the real engine over a fake or fault-injecting runner.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from absl import app

from serving.config import EngineConfig
from serving.entrypoints.flags import (
    FLAGS,
    batch_config_from_flags,
    engine_config_from_flags,
    lora_modules_from_flags,
    serve_config_from_flags,
)

COMMANDS = ("serve", "generate", "batch", "convert", "bench")
EXIT_ENGINE_DEAD = 3  # `serve` exit status when the engine died or wedged
if TYPE_CHECKING:  # the engine package is imported by the commands that build one
  from serving.engine import EngineClient

EngineFactory = Callable[[str, EngineConfig], "EngineClient"]


def default_build_engine(model: str, config: EngineConfig) -> EngineClient:
  from serving.entrypoints.engine_builder import build_engine

  return build_engine(model, config)


def build_with_loras(build_engine: EngineFactory, config: EngineConfig) -> EngineClient:
  """The engine of --model, with every --lora_modules adapter loaded (UsageError if one
  cannot be served: a server must not start without an adapter it was told to serve)."""
  modules = lora_modules_from_flags()
  engine = build_engine(FLAGS.model, config)
  for name, path in modules.items():
    try:
      engine.load_lora(name, path)
    except ValueError as e:
      raise app.UsageError(f"--lora_modules {name}={path}: {e}") from None
  return engine


def cmd_serve(build_engine: EngineFactory) -> int:
  from serving.engine import EngineDeadError
  from serving.entrypoints.api_server import serve

  config = engine_config_from_flags()
  serve_cfg = serve_config_from_flags()
  # Until the servers run, SIGTERM has nothing to drain: exit cleanly.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  from sharding.distributed import initialize_from

  dist = initialize_from(FLAGS)
  if dist.num_processes > 1:
    # Every process runs the steps in lock-step; only process 0 serves.
    from serving.entrypoints.engine_builder import start_multihost
    engine = start_multihost(FLAGS.model, config)
    if engine is None:
      return 0
  else:
    engine = build_with_loras(build_engine, config)

  def ready(http_port: int | None, grpc_port: int | None) -> None:
    print(f"xlaserve ready: model={serve_cfg.served_model_name} host={serve_cfg.host} "
          f"http_port={http_port} grpc_port={grpc_port}", flush=True)

  async def main() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
      loop.add_signal_handler(sig, stop.set)
    await serve(engine, serve_cfg, stop, ready)

  try:
    asyncio.run(main())
  except EngineDeadError as e:
    # The engine thread may be stuck in a device call: leave without waiting for it.
    print(f"xlaserve: the engine cannot serve ({e}); exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_ENGINE_DEAD)
  print("xlaserve: drained, exiting", flush=True)
  return 0


def cmd_generate(build_engine: EngineFactory) -> int:
  from serving.entrypoints.llm import LLM
  from serving.types import SamplingParams

  if not FLAGS.prompt:
    raise app.UsageError("generate needs --prompt")
  llm = LLM(engine=build_with_loras(build_engine, engine_config_from_flags()))
  params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                          top_p=FLAGS.top_p, top_k=FLAGS.top_k)
  if FLAGS.chat:
    out = llm.chat([{"role": "user", "content": FLAGS.prompt}], params)[0]
  else:
    out = llm.generate([FLAGS.prompt], params)[0]
  print(out.text)
  return 0


def cmd_batch(build_engine: EngineFactory) -> int:
  from serving.entrypoints.batch import run_batch

  config = engine_config_from_flags()
  batch_cfg = batch_config_from_flags(config)
  engine = build_with_loras(build_engine, config)
  summary = asyncio.run(run_batch(engine, batch_cfg))
  print(json.dumps(summary), flush=True)
  if summary["failed"]:
    print(f"xlaserve batch: {summary['failed']} lines failed on the server side; rerun the same "
          "command to redo them", file=sys.stderr, flush=True)
    return 1
  return 0


def cmd_convert() -> int:
  from serving.tools.convert import convert

  if not FLAGS.output:
    raise app.UsageError("convert needs --output=DIR")
  method = FLAGS.quantization if FLAGS.quantization != "none" else None
  out = convert(FLAGS.model, FLAGS.output, method)
  print(f"wrote orbax checkpoint {out}", flush=True)
  return 0


def cmd_bench(argv: list[str]) -> int:
  from serving.tools import bench

  return bench.main(argv) or 0


def main(argv: list[str], build_engine: EngineFactory = default_build_engine) -> int:
  if len(argv) < 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"usage: xlaserve {{{'|'.join(COMMANDS)}}} [--flags]")
  command, rest = argv[1], argv[2:]
  if command == "bench":
    return cmd_bench(argv[1:])
  if rest:
    raise app.UsageError(f"unexpected arguments {rest}")
  if command == "convert":
    return cmd_convert()
  return {"serve": cmd_serve, "generate": cmd_generate, "batch": cmd_batch}[command](build_engine)


def run(build_engine: EngineFactory = default_build_engine) -> None:
  """Console-script entry point (`xlaserve`)."""
  if len(sys.argv) > 1 and sys.argv[1] == "bench":
    from serving.tools import bench  # noqa: F401  (imported before parsing: its flags exist)
  # `--help` lists the main module's flags and docstring; the console script has neither.
  main_module = sys.modules["__main__"]
  main_module.__doc__ = main_module.__doc__ or __doc__
  for flag in FLAGS.get_key_flags_for_module("serving.entrypoints.flags"):
    FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(functools.partial(main, build_engine=build_engine))


if __name__ == "__main__":
  run()
