"""The `xlaserve` command's help, written for its users: what each command does, its main
flags (one line each, the default read from the flag) and an example.

`xlaserve --help` and `xlaserve COMMAND --help` print it (`render`); absl's
`--helpfull` still lists every flag of every module. `SHORT_USAGE` is what a
missing command prints. Every flag named here must exist (tests check it).
"""

from __future__ import annotations

import dataclasses
import textwrap

from absl import flags

FLAGS = flags.FLAGS
COMMANDS = ("serve", "generate", "batch", "convert", "bench")
HELP_ARGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort")
PARSER_FLAGS = ("flagfile",)  # absl's parser reads them; they are not defined flags
SHORT_USAGE = (f"usage: xlaserve COMMAND [--flags]   (COMMAND: {', '.join(COMMANDS)})\n"
               "Run `xlaserve --help` for what each command does, `xlaserve COMMAND --help` "
               "for its flags.")

Section = tuple[str, tuple[tuple[str, str], ...]]  # title, ((flag, one line), ...)


@dataclasses.dataclass(frozen=True)
class CommandHelp:
  summary: str  # one line, in the command list
  about: str
  sections: tuple[Section, ...]
  examples: tuple[str, ...]


MODEL: Section = ("Model and engine", (
    ("model", "Preset, HF dir, .gguf file or orbax dir."),
    ("config", "Engine preset: a name in configs/ (e.g. cpu-small) or a JSON file."),
    ("max_num_seqs", "Requests run together (decode slots)."),
    ("max_model_len", "Longest prompt + completion, in tokens."),
    ("num_pages", "KV cache pages (default: sized from --kv_cache_memory_fraction)."),
    ("dtype", "Weights and activations: float32 or bfloat16."),
    ("quantization", "Weights: int8, int4, fp8, or gguf (a GGUF file's blocks as stored)."),
    ("tp", "Tensor parallel degree (devices per model copy)."),
    ("dp", "Data parallel replicas (each on its own devices)."),
))
GENERAL: Section = ("General", (
    ("flagfile", "Read more flags from this file, one per line."),
    ("verbose", "Show the full traceback of an error (or set XLASERVE_DEBUG=1)."),
))

HELP = {
    "serve": CommandHelp(
        summary="Serve a model over an OpenAI-compatible HTTP API and gRPC.",
        about="Loads the model, then serves /v1/completions, /v1/chat/completions, "
              "/v1/models, /health and /metrics over HTTP, and the xlaserve.v1 Generation "
              "service over gRPC. Prints `xlaserve ready: ...` on stdout once both accept "
              "connections. SIGTERM or Ctrl-C finishes the requests in flight, then exits.",
        sections=(MODEL, ("Server", (
            ("host", "Interface to listen on (0.0.0.0 for all)."),
            ("http_port", "HTTP port (0: any free port, -1: no HTTP)."),
            ("grpc_port", "gRPC port (0: any free port, -1: no gRPC)."),
            ("served_model_name", "Model id clients send (default: --model)."),
            ("api_key", "Require `Authorization: Bearer KEY` (or set XLASERVE_API_KEY)."),
            ("tls_cert", "PEM certificate: HTTPS and gRPC over TLS (with --tls_key)."),
            ("max_queued_requests", "Requests that may wait beyond --max_num_seqs "
                                    "(then 429)."),
            ("drain_timeout_s", "On SIGTERM, how long requests in flight may take."),
            ("kv_events_endpoint", "Publish KV-cache events for prefix-aware routers "
                                   "(ZMQ, vLLM's format; docs/kv_events.md)."),
        )), GENERAL),
        examples=(
            "xlaserve serve --model=smollm2-135m-instruct --config=cpu-small",
            "curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
            "    -d '{\"model\": \"smollm2-135m-instruct\", \"prompt\": \"Hello\", "
            "\"max_tokens\": 16}'",
        )),
    "generate": CommandHelp(
        summary="Complete one prompt and print the text.",
        about="Loads the model, completes --prompt and prints the completion on stdout "
              "(start-up reports go to stderr).",
        sections=(("Prompt and sampling", (
            ("prompt", "The prompt (required)."),
            ("chat", "Treat --prompt as a user message (the model's chat template)."),
            ("max_tokens", "Tokens to generate."),
            ("temperature", "Sampling temperature (0: greedy)."),
            ("top_p", "Nucleus sampling."),
            ("top_k", "Top-k sampling (-1: off)."),
        )), MODEL, GENERAL),
        examples=('xlaserve generate --prompt="The capital of France is" --max_tokens=16',
                  'xlaserve generate --chat --prompt="Write a haiku about XLA"')),
    "batch": CommandHelp(
        summary="Run an OpenAI batch file (JSONL) offline.",
        about="Reads requests in the OpenAI batch format (one JSON object per line with "
              "custom_id, method, url and body), runs them and writes one result per line, in "
              "input order. Rerunning the same command resumes after the lines already "
              "written. Exits 1 when some lines failed on the server side.",
        sections=(("Batch", (
            ("input", "Input JSONL file (required)."),
            ("output", "Output JSONL file (required)."),
            ("max_concurrency", "Requests in flight (default: 2 x --max_num_seqs)."),
        )), MODEL, GENERAL),
        examples=("xlaserve batch --input=requests.jsonl --output=results.jsonl",)),
    "convert": CommandHelp(
        summary="Convert a checkpoint to xlaserve's orbax format, optionally quantized.",
        about="Reads --model (preset, Hugging Face directory, .gguf file) and writes an "
              "orbax directory that loads faster; --model accepts that directory later.",
        sections=(("Convert", (
            ("model", "The checkpoint to read."),
            ("output", "Directory to write (required)."),
            ("quantization", "Store the weights quantized: int8, int4 or fp8."),
        )), GENERAL),
        examples=("xlaserve convert --model=./my-hf-model --output=./my-model-int8 "
                  "--quantization=int8",)),
    "bench": CommandHelp(
        summary="Measure throughput and latency: offline, against a server, or the roofline.",
        about="xlaserve bench offline | serve | roofline. `offline` runs a fixed workload "
              "through the engine; `serve` sweeps concurrency levels against any "
              "OpenAI-compatible server; `roofline` compares a run with the machine's memory "
              "bandwidth and FLOPs. Results print as one JSON object.",
        sections=(("Workload", (
            ("num_prompts", "Prompts in the workload."),
            ("input_len", "Tokens per prompt."),
            ("output_len", "Output tokens per request."),
            ("base_url", "serve: the server to measure."),
            ("concurrency", "serve: concurrency levels."),
            ("result_json", "Also write the results to this file."),
        )), MODEL, GENERAL),
        examples=("xlaserve bench offline --config=cpu-small --num_prompts=16",
                  "xlaserve bench serve --base_url=http://127.0.0.1:8000 "
                  "--concurrency=1,4,16")),
}


def help_requested(argv: list[str]) -> bool:
  """True when the arguments (before a `--`) ask for help."""
  args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  return any(a in HELP_ARGS for a in args) or (bool(args) and args[0] == "help")


def command_in(argv: list[str]) -> str | None:
  """The first command named in the arguments (None: none; the overview's help)."""
  return next((a for a in argv[1:] if a in COMMANDS), None)


def render(command: str | None = None) -> str:
  """The help of `command`, or the overview of all commands."""
  if command is None:
    return _overview()
  h = HELP[command]
  lines = [f"usage: xlaserve {command} [--flags]", "", h.summary, "",
           *textwrap.wrap(h.about, 90), ""]
  for title, rows in h.sections:
    lines += [f"{title}:", *(_flag_line(name, text) for name, text in rows), ""]
  lines += ["Example:" if len(h.examples) == 1 else "Examples:",
            *(f"  {e}" for e in h.examples), "",
            "Every flag of every module: xlaserve --helpfull"]
  return "\n".join(lines)


def _overview() -> str:
  width = max(len(c) for c in COMMANDS) + 2
  lines = ["xlaserve: serve large language models with JAX / XLA.", "",
           "usage: xlaserve COMMAND [--flags]", "", "Commands:",
           *(f"  {c:<{width}}{HELP[c].summary}" for c in COMMANDS), ""]
  lines += ["Common flags:", *(_flag_line(n, t) for n, t in MODEL[1][:2] + GENERAL[1]), ""]
  lines += ["Examples:", "  xlaserve serve --model=smollm2-135m-instruct --config=cpu-small",
            '  xlaserve generate --prompt="The capital of France is" --max_tokens=16', "",
            "`xlaserve COMMAND --help` shows a command's main flags; "
            "`xlaserve --helpfull` every flag."]
  return "\n".join(lines)


def _flag_line(name: str, text: str) -> str:
  default = _default(name)
  suffix = f" (default: {default})" if default else ""
  return f"  --{name:<20} {text}{suffix}"


def _default(name: str) -> str:
  """The flag's default as given on the command line ('' when it has none worth showing)."""
  if name not in FLAGS:
    return ""
  value = FLAGS[name].default
  if value is None or value is False:
    return ""
  if isinstance(value, list):
    return ",".join(str(v) for v in value)
  return str(value).lower() if isinstance(value, bool) else str(value)
