"""The `xlaserve` command's flags and the frozen configs made from them.

Flags are defined only here and read only by the entry points (the launcher,
`xlaserve bench`). Engine options resolve, last one wins: EngineConfig
defaults < the model preset's `engine` block < `--config` preset
(configs/<name>.json or a JSON path) < flags given; a `dtype` given without a
`weight_dtype` drops the model preset's `weight_dtype` too.
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app, flags

from checkpoints import presets
from checkpoints.presets import CONFIGS_DIR
from serving import config as config_lib
from serving.config import EngineConfig
from serving.entrypoints.limits import RequestLimits

FLAGS = flags.FLAGS

# Shared.
flags.DEFINE_string("model", "smollm2-135m-instruct", "Model: preset name, HF dir, .gguf, orbax.")
flags.DEFINE_string("config", None, "Engine preset: a name in configs/ (e.g. cpu-small) or a path.")
flags.DEFINE_bool("verbose", False, "On an error in the command's input (a bad flag, model "
                  "path, layout or port), also show the full traceback (or set XLASERVE_DEBUG=1).")
# Engine (names and meaning of EngineConfig's fields; unset -> preset or default).
flags.DEFINE_integer("max_num_seqs", None, "Decode slots (requests run together).")
flags.DEFINE_integer("max_model_len", None, "Longest prompt + completion, in tokens.")
flags.DEFINE_integer("page_size", None, "Tokens per KV cache page.")
flags.DEFINE_integer("num_pages", None, "KV cache pages (default: from the memory fraction).")
flags.DEFINE_float("kv_cache_memory_fraction", None, "Device memory share for the KV cache.")
flags.DEFINE_integer("max_num_batched_tokens", None, "Token budget of one prefill step.")
flags.DEFINE_bool("enable_prefix_caching", None, "Share KV pages of common prompt prefixes.")
flags.DEFINE_enum("attention_backend", None, config_lib.ATTENTION_BACKENDS, "Attention kernel.")
flags.DEFINE_enum("dtype", None, config_lib.DTYPES, "Weight / activation dtype.")
flags.DEFINE_enum("weight_dtype", None, config_lib.DTYPES,
                  "Dtype of unquantized weights (default: --dtype); e.g. bfloat16 weights with "
                  "float32 activations.")
flags.DEFINE_enum("kv_cache_dtype", None, config_lib.KV_CACHE_DTYPES, "KV cache dtype.")
flags.DEFINE_enum("quantization", None, ["auto", "none", "int8", "int4", "fp8", "gguf"],
                  "Weight quantization (default auto: a GGUF file's blocks as stored, other "
                  "checkpoints as loaded; none: dequantize a GGUF; gguf: require a GGUF).")
flags.DEFINE_bool("quantized_dense_copy", None,
                  "With --quantization on CPU: also keep a --weight_dtype copy of the weights; "
                  "small decode batches read the codes (native kernel), prefill and large "
                  "batches the copy.")
flags.DEFINE_integer("cpu_activation_bits", None,
                     "With nibble (Q4) or Q8_0 weights on CPU: round activations per group of "
                     "32 to this many bits in the native kernel's integer dot products (8: "
                     "llama.cpp's scheme, fastest; 16: 2^-16 of each group's max; 32: float).")
flags.DEFINE_bool("cpu_weight_tiles", None,
                  "With Q8_0 / Q4 weights on an AVX-512 VNNI CPU: lay them out once at load "
                  "as the native kernel reads them (default true; same results, faster "
                  "decode). false: keep the stored rows.")
flags.DEFINE_integer("tp", None, "Tensor parallel degree.")
flags.DEFINE_integer("ep", None, "Expert parallel degree.")
flags.DEFINE_integer("dp", None, "Data parallel replicas.")
flags.DEFINE_integer("pp", None, "Pipeline parallel stages (layers split into consecutive "
                     "stages, microbatches in flight between them).")
flags.DEFINE_list("prefill_buckets", None, "Prefill token buckets (default: powers of two).")
flags.DEFINE_list("decode_buckets", None, "Decode batch buckets (default: powers of two).")
flags.DEFINE_integer("attention_block_tokens", None, "Keys per step of the XLA attention loop.")
flags.DEFINE_string("kv_events_endpoint", None, "Publish KV-cache events (vLLM's BlockStored / "
                    "BlockRemoved / AllBlocksCleared, docs/kv_events.md) on this ZMQ PUB "
                    "endpoint: tcp://*:5557 binds, tcp://HOST:5557 connects to a subscriber.")
flags.DEFINE_string("kv_events_topic", None, "KV events: the topic frame (llm-d reads "
                    "kv@<pod>@<model>).")
flags.DEFINE_string("kv_events_replay_endpoint", None, "KV events: a ZMQ ROUTER endpoint "
                    "that replays recent batches from a sequence number (bound).")
flags.DEFINE_enum("kv_events_format", None, config_lib.KV_EVENTS_FORMATS, "KV events: "
                  "positional arrays (vLLM <= 0.2x, read by every consumer) or tagged maps "
                  "(vLLM after PR 42892).")
flags.DEFINE_bool("compilation_cache", None, "Persist compiled programs on disk.")
flags.DEFINE_string("compilation_cache_dir", None, "Where the compilation cache lives.")
flags.DEFINE_integer("seed", None, "Engine seed for requests that bring none (default: a "
                     "fresh one per process).")
flags.DEFINE_float("step_timeout_s", None, "A step running longer marks the engine wedged: "
                   "health turns 503 and the process exits non-zero.")
flags.DEFINE_bool("unroll_layers", None, "Unroll the layer loop (default: on CPU only).")
flags.DEFINE_integer("max_loras", None, "LoRA adapter slots on the device (0: LoRA off; default "
                     "with --lora_modules: one per adapter, at most 4).")
flags.DEFINE_integer("max_lora_rank", None, "Largest LoRA rank served (the slots' rank).")
flags.DEFINE_list("lora_modules", None, "LoRA adapters to serve: name=path,... (PEFT "
                  "directories); clients pick one by `model`.")
flags.DEFINE_enum("speculative_method", None, config_lib.SPECULATIVE_METHODS,
                  "Speculative decoding: draft tokens from n-gram prompt lookup, suffix "
                  "decoding, or a draft model (docs/spec_decode.md).")
flags.DEFINE_integer("num_speculative_tokens", None, "Drafts verified per request and step.")
flags.DEFINE_string("speculative_model", None, "The draft model (--speculative_method=draft), "
                    "named as --model; it must use the target's tokenizer.")
flags.DEFINE_integer("prompt_lookup_min", None, "Shortest n-gram the ngram proposer matches.")
flags.DEFINE_integer("prompt_lookup_max", None, "Longest n-gram the ngram proposer matches.")
flags.DEFINE_integer("speculative_max_batch", None, "Speculate only while at most this many "
                     "requests run (back-off).")
flags.DEFINE_integer("num_decode_steps", None, "Multi-step decoding: decode iterations per "
                     "device call while only a few requests decode and none waits (1: off).")
flags.DEFINE_integer("decode_steps_max_batch", None, "Multi-step decoding only while at most "
                     "this many requests decode.")
flags.DEFINE_integer("prefill_workers", None, "Disaggregated serving: engines that prefill "
                     "(each on its own tp*ep*pp devices); needs --decode_workers.")
flags.DEFINE_integer("decode_workers", None, "Disaggregated serving: engines that decode "
                     "after the prefill's KV pages reach them; needs --prefill_workers.")
flags.DEFINE_integer("kv_transfer_pages", None, "KV pages per transfer chunk (disaggregated).")
flags.DEFINE_float("kv_offload_host_gb", None, "Tiered prefix cache: GiB of host memory that "
                   "keeps KV pages evicted from the device pool (0: off).")
flags.DEFINE_string("kv_offload_disk_dir", None, "Tiered prefix cache: a directory that keeps "
                    "pages evicted from the host tier (needs --kv_offload_disk_gb).")
flags.DEFINE_float("kv_offload_disk_gb", None, "Tiered prefix cache: GiB the disk tier may use.")
flags.DEFINE_enum("kv_role", None, config_lib.KV_ROLES, "Prefill / decode across servers: "
                  "`prefill` offers its prompts' KV pages to decode servers, `decode` pulls "
                  "them (vLLM's kv_transfer_params), `both` (default) neither.")
ENGINE_FLAGS = ("max_num_seqs", "max_model_len", "page_size", "num_pages",
                "kv_cache_memory_fraction", "max_num_batched_tokens", "enable_prefix_caching",
                "attention_backend", "dtype", "weight_dtype", "kv_cache_dtype", "quantization",
                "quantized_dense_copy", "cpu_activation_bits", "cpu_weight_tiles", "tp", "ep",
                "dp", "pp",
                "prefill_workers", "decode_workers", "kv_transfer_pages", "kv_role",
                "prefill_buckets", "decode_buckets", "attention_block_tokens", "compilation_cache",
                "kv_events_endpoint", "kv_events_topic", "kv_events_replay_endpoint",
                "kv_events_format",
                "compilation_cache_dir", "seed", "unroll_layers", "step_timeout_s", "max_loras",
                "max_lora_rank", "speculative_method", "num_speculative_tokens",
                "speculative_model", "prompt_lookup_min", "prompt_lookup_max",
                "speculative_max_batch", "num_decode_steps", "decode_steps_max_batch",
                "kv_offload_host_gb", "kv_offload_disk_dir", "kv_offload_disk_gb")
# serve.
# Multi-host (jax.distributed); unset -> $JAX_COORDINATOR_ADDRESS etc., or one process.
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index (0 serves).")
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 / :: for all).")
flags.DEFINE_integer("http_port", 8000, "OpenAI-compatible HTTP port (-1 disables).")
flags.DEFINE_integer("grpc_port", 9000, "gRPC port (-1 disables).")
flags.DEFINE_string("served_model_name", None, "Model id clients use (default: --model).")
flags.DEFINE_string("api_key", None, "Require this Bearer key (default: $XLASERVE_API_KEY).")
flags.DEFINE_string("tls_cert", None, "PEM certificate: serve HTTPS and gRPC over TLS.")
flags.DEFINE_string("tls_key", None, "PEM private key for --tls_cert.")
flags.DEFINE_integer("max_queued_requests", 256, "Requests queued beyond max_num_seqs "
                     "before HTTP 429 / RESOURCE_EXHAUSTED (-1: unlimited).")
flags.DEFINE_integer("max_body_bytes", 4 * 1024 * 1024,
                     "Largest HTTP request body / gRPC request message.")
flags.DEFINE_float("drain_timeout_s", 30.0, "On SIGTERM, time allowed for in-flight requests.")
flags.DEFINE_float("body_timeout_s", 30.0, "HTTP: a request body arriving slower gets 408.")
flags.DEFINE_float("header_timeout_s", 10.0, "HTTP: a connection whose request headers take "
                   "longer is closed.")
flags.DEFINE_integer("max_connections", 1024, "Open HTTP connections / concurrent gRPC calls "
                     "served; beyond them new requests get 503 / RESOURCE_EXHAUSTED.")
flags.DEFINE_float("kv_transfer_timeout_s", 30.0, "--kv_role=prefill|decode: KV pages pinned "
                   "for a decode server are released after this; a transfer step waiting "
                   "longer fails (the decode server then prefills the request itself).")
# Per-request limits (serve and batch; serving/entrypoints/limits.py). Beyond one: 400.
_LIMITS = RequestLimits()
flags.DEFINE_integer("max_prompts_per_request", _LIMITS.max_prompts,
                     "Prompts in one completions request.")
flags.DEFINE_integer("max_n", _LIMITS.max_n, "Completions per prompt (`n`).")
flags.DEFINE_integer("max_choices_per_request", _LIMITS.max_choices,
                     "Completions one request may ask for in all (prompts x n).")
flags.DEFINE_integer("max_stop", _LIMITS.max_stop, "Stop strings per request.")
flags.DEFINE_integer("max_stop_chars", _LIMITS.max_stop_chars, "Characters of a stop string.")
flags.DEFINE_integer("max_stop_token_ids", _LIMITS.max_stop_token_ids,
                     "stop_token_ids per request.")
flags.DEFINE_integer("max_logprobs", _LIMITS.max_logprobs, "Top alternatives per token.")
flags.DEFINE_integer("max_input_chars", _LIMITS.max_input_chars,
                     "Characters of text one request hands to the tokenizer / chat template.")
flags.DEFINE_integer("max_request_id_chars", _LIMITS.max_request_id_chars,
                     "Characters of a client-chosen request id (gRPC).")
flags.DEFINE_bool("allow_runtime_lora", False,
                  "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (and the gRPC "
                  "equivalents): clients may then make the server read adapter directories.")
flags.DEFINE_bool("allow_request_chat_template", False,
                  "Let requests bring their own Jinja chat template "
                  "(chat_template_kwargs.chat_template). Off: such requests get 400.")
# generate.
flags.DEFINE_string("prompt", None, "generate: the prompt.")
flags.DEFINE_bool("chat", False, "generate: treat --prompt as a user message (chat template).")
flags.DEFINE_integer("max_tokens", 64, "generate: tokens to generate.")
flags.DEFINE_float("temperature", 0.0, "generate: sampling temperature (0 = greedy).")
flags.DEFINE_float("top_p", 1.0, "generate: nucleus sampling.")
flags.DEFINE_integer("top_k", -1, "generate: top-k (-1 disables).")
# batch / convert.
flags.DEFINE_string("input", None, "batch: input JSONL (OpenAI batch format).")
flags.DEFINE_string("output", None, "batch: output JSONL; convert: output directory.")
flags.DEFINE_integer("max_concurrency", None, "batch: requests in flight (default 2 x slots).")


def load_engine_preset(name_or_path: str) -> dict[str, Any]:
  """EngineConfig kwargs from configs/<name>.json or a JSON file path."""
  path = name_or_path
  if not os.path.exists(path):
    path = os.path.join(CONFIGS_DIR, f"{name_or_path.removesuffix('.json')}.json")
  if not os.path.exists(path):
    names = sorted(f[:-5] for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))
    raise app.UsageError(f"--config={name_or_path}: no such preset (configs/: {names})")
  with open(path, encoding="utf-8") as f:
    raw = json.load(f)
  values = raw.get("engine", raw) if "package" in raw else raw
  known = set(config_lib.OPTION_GROUPS)
  unknown = sorted(set(values) - known - {"description"})
  if unknown:
    raise app.UsageError(f"--config={name_or_path}: unknown engine options {unknown}")
  return {k: v for k, v in values.items() if k in known}


def engine_config_from_flags() -> EngineConfig:
  """EngineConfig from model preset defaults, --config and the flags given."""
  given = load_engine_preset(FLAGS.config) if FLAGS.config else {}
  for name in ENGINE_FLAGS:
    if FLAGS[name].value is not None:
      given[name] = FLAGS[name].value
  values = config_lib.merge_engine_options(presets.engine_defaults(FLAGS.model), given,
                                             config_lib.expected_platform())
  if "quantization" in values and values["quantization"] == "none":
    values["quantization"] = None
  for name in ("prefill_buckets", "decode_buckets"):
    if values.get(name) is not None:
      values[name] = tuple(int(b) for b in values[name])
  modules = lora_modules_from_flags()
  if modules and not values.get("max_loras"):
    values["max_loras"] = config_lib.default_max_loras(len(modules))
  try:
    return EngineConfig.of(**values)
  except (TypeError, ValueError) as e:
    raise app.UsageError(f"invalid engine options: {e}") from None


def lora_modules_from_flags() -> dict[str, str]:
  """--lora_modules name=path,... as {name: path} (UsageError when malformed)."""
  modules: dict[str, str] = {}
  for item in FLAGS.lora_modules or []:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      raise app.UsageError(f"--lora_modules: {item!r} is not name=path")
    if name in modules:
      raise app.UsageError(f"--lora_modules: {name!r} given twice")
    modules[name] = path
  return modules


def serve_config_from_flags() -> Any:
  """The `ServeConfig` of `xlaserve serve` (HTTP / gRPC options)."""
  from serving.entrypoints.api_server import ServeConfig  # the server stack, only when serving

  queued = None if FLAGS.max_queued_requests < 0 else FLAGS.max_queued_requests
  try:
    return ServeConfig(
        served_model_name=FLAGS.served_model_name or FLAGS.model, host=FLAGS.host,
        http_port=FLAGS.http_port, grpc_port=FLAGS.grpc_port,
        api_key=FLAGS.api_key or os.environ.get("XLASERVE_API_KEY") or None,
        tls_cert=FLAGS.tls_cert, tls_key=FLAGS.tls_key, max_queued_requests=queued,
        max_body_bytes=FLAGS.max_body_bytes, body_timeout_s=FLAGS.body_timeout_s,
        header_timeout_s=FLAGS.header_timeout_s,
        max_connections=FLAGS.max_connections, drain_timeout_s=FLAGS.drain_timeout_s,
        allow_runtime_lora=FLAGS.allow_runtime_lora,
        kv_transfer_timeout_s=FLAGS.kv_transfer_timeout_s, limits=limits_from_flags())
  except ValueError as e:
    raise app.UsageError(str(e)) from None


def limits_from_flags() -> RequestLimits:
  try:
    return RequestLimits(
        max_prompts=FLAGS.max_prompts_per_request, max_n=FLAGS.max_n,
        max_choices=FLAGS.max_choices_per_request, max_stop=FLAGS.max_stop,
        max_stop_chars=FLAGS.max_stop_chars, max_stop_token_ids=FLAGS.max_stop_token_ids,
        max_logprobs=FLAGS.max_logprobs, max_input_chars=FLAGS.max_input_chars,
        max_request_id_chars=FLAGS.max_request_id_chars,
        allow_request_chat_template=FLAGS.allow_request_chat_template)
  except ValueError as e:
    raise app.UsageError(f"invalid request limits: {e}") from None


def batch_config_from_flags(config: EngineConfig) -> Any:
  """The `BatchConfig` of `xlaserve batch`."""
  from serving.entrypoints.batch import BatchConfig

  if not FLAGS.input or not FLAGS.output:
    raise app.UsageError("batch needs --input and --output")
  return BatchConfig(
      input_path=FLAGS.input, output_path=FLAGS.output,
      served_model_name=FLAGS.served_model_name or FLAGS.model,
      max_concurrency=FLAGS.max_concurrency or 2 * config.scheduler.max_num_seqs,
      limits=limits_from_flags())
