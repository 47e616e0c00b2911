"""`xlaserve` command line (absl): serve | generate | batch | convert | bench.

    xlaserve serve    --model=smollm2-135m-instruct --http_port=8000 --grpc_port=9000
    xlaserve generate --prompt="Hello" --max_tokens=32
    xlaserve batch    --input=in.jsonl --output=out.jsonl
    xlaserve convert  --model=... --output=DIR
    xlaserve bench    ...            (flags and behaviour owned by serving.tools.bench)

`run()` is the console script. `--help` (`xlaserve --help`, `xlaserve COMMAND
--help`) prints the user help of serving/entrypoints/cli_help.py; absl's
`--helpfull` lists every flag. The flags live in serving/entrypoints/flags.py;
`main()` turns them into frozen configs (`EngineConfig`, `ServeConfig`,
`BatchConfig`) that are passed down. `run(build_engine=...)` takes the function
that makes the engine from the model name and the `EngineConfig` (default: load
the checkpoint); tests pass one that builds the real engine over a fake or
fault-injecting runner.

Exit status: 0 done; 1 `batch` lines failed, or a bug (with its traceback);
2 (`EXIT_USAGE`) the command's input is wrong: no or an unknown command, a bad
flag or flag value, options that do not go together, a model that cannot be
found, a layout needing more devices than are visible, a port that cannot be
bound. Those errors (`USER_ERRORS`: absl's UsageError, `SetupError`,
`BindError`, and flag parsing errors) print one line on stderr, with the
traceback before it only under `--verbose` or XLASERVE_DEBUG=1
(`report_usage_error`, the one place that does it). 3 (`EXIT_ENGINE_DEAD`)
`serve`: the engine died or wedged while serving.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from absl import app, flags

from serving.config import EngineConfig
from serving.entrypoints import cli_help
from serving.entrypoints.cli_help import COMMANDS
from serving.entrypoints.flags import (
    FLAGS,
    batch_config_from_flags,
    engine_config_from_flags,
    lora_modules_from_flags,
    serve_config_from_flags,
)
from serving.entrypoints.startup import BindError, SetupError, check_ports_free

EXIT_USAGE = 2  # the command's input is wrong (one line on stderr)
EXIT_ENGINE_DEAD = 3  # `serve` exit status when the engine died or wedged
if TYPE_CHECKING:  # the engine package is imported by the commands that build one
  from serving.engine import EngineClient

# Errors that are the command's input, not a bug (flag parsing errors are handled as one).
USER_ERRORS = (app.UsageError, SetupError, BindError)
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
  dist = start_distributed(serve_cfg)
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


def start_distributed(serve_cfg: Any) -> Any:
  """`jax.distributed` from the flags (one process unless they or the environment say
  otherwise; UsageError when they do not add up). The process that will listen checks
  its ports before any model loads."""
  from sharding.distributed import DistributedConfig, initialize_from

  try:
    DistributedConfig.resolve(FLAGS)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  dist = initialize_from(FLAGS)
  if dist.is_leader:
    check_ports_free(serve_cfg.host, {"--http_port": serve_cfg.http_port,
                                      "--grpc_port": serve_cfg.grpc_port})
  return dist


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
  from serving.entrypoints.engine_builder import check_model, load_method
  from serving.tools.convert import convert

  if not FLAGS.output:
    raise app.UsageError("convert needs --output=DIR")
  method = FLAGS.quantization if FLAGS.quantization != "none" else None
  check_model(FLAGS.model, method)
  method = load_method(FLAGS.model, method)
  out = convert(FLAGS.model, FLAGS.output, method)
  print(f"wrote orbax checkpoint {out}", flush=True)
  return 0


def cmd_bench(argv: list[str]) -> int:
  from serving.tools import bench

  return bench.main(argv) or 0


def main(argv: list[str], build_engine: EngineFactory = default_build_engine) -> int:
  """Runs the command of `argv` (flags already parsed); returns the exit status. Errors
  in the command's input (`USER_ERRORS`) become one line on stderr and EXIT_USAGE."""
  try:
    return run_command(argv, build_engine)
  except USER_ERRORS as e:
    return report_usage_error(e)


def run_command(argv: list[str], build_engine: EngineFactory = default_build_engine) -> int:
  """Dispatches `argv[1]` (the command) to its `cmd_*`; returns the exit status."""
  if len(argv) < 2:
    print(cli_help.SHORT_USAGE, file=sys.stderr, flush=True)
    return EXIT_USAGE
  command, rest = argv[1], argv[2:]
  if command not in COMMANDS:
    raise app.UsageError(f"unknown command {command!r}; usage: xlaserve "
                         f"{{{'|'.join(COMMANDS)}}} [--flags] (see xlaserve --help)")
  if command == "bench":
    return cmd_bench(argv[1:])
  if rest:
    raise app.UsageError(f"unexpected arguments {rest} (flags are written --name=value)")
  if command == "convert":
    return cmd_convert()
  return {"serve": cmd_serve, "generate": cmd_generate, "batch": cmd_batch}[command](build_engine)


def report_usage_error(error: BaseException) -> int:
  """Prints `error` as one line on stderr (its traceback first with --verbose or
  XLASERVE_DEBUG=1); returns EXIT_USAGE."""
  verbose = FLAGS.is_parsed() and FLAGS.verbose
  if verbose or os.environ.get("XLASERVE_DEBUG", "").lower() not in ("", "0", "false"):
    traceback.print_exception(error)
  message = " ".join(str(error).split()) or type(error).__name__
  print(f"xlaserve: {message}", file=sys.stderr, flush=True)
  return EXIT_USAGE


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, a bad flag or value reported as one line (exit status 2)."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    sys.exit(report_usage_error(e))


def run(build_engine: EngineFactory = default_build_engine) -> None:
  """Console-script entry point (`xlaserve`)."""
  command = cli_help.command_in(sys.argv)
  if command == "bench":
    from serving.tools import bench  # noqa: F401  (imported before parsing: its flags exist)
  if cli_help.help_requested(sys.argv):
    print(cli_help.render(command), flush=True)
    sys.exit(0)
  # `--helpfull` starts with the main module's docstring; the console script has none.
  sys.modules["__main__"].__doc__ = cli_help.SHORT_USAGE
  app.run(functools.partial(main, build_engine=build_engine), flags_parser=parse_flags)


if __name__ == "__main__":
  run()
