"""Model name + `EngineConfig` -> a ready engine (an `EngineClient`): load, place, warm up.

The one place that wires the layers together for the entry points (`LLM`,
`xlaserve serve | batch`, benchmarks):
  1. `load_model` reads the checkpoint on the host (checkpoints/): a preset,
     HF directory, GGUF file or orbax directory; with `quantization`, GGUF
     blocks of the matching type are kept as stored.
  2. `prepare_weights` (serving/runner/weights.py) makes the weights ready on
     the host (quantized, unstacked, adapted to the mesh) and `ModelRunner`
     puts them on the device(s) and sizes the KV cache; with
     `speculative_method="draft"` the draft model (`speculative_model`) is
     loaded the same way, checked against the target's tokenizer and prepared
     with it.
  3. `LLMEngine(runner=, tokenizer=, config=)` warms the runner up; with `dp`
     or prefill / decode workers, several of them behind a `ReplicatedEngine`
     or a `DisaggregatedEngine`. The front ends see only `EngineClient`.
  4. LoRA adapters given as `lora_modules` are read, validated against the
     model (checkpoints/lora.py) and registered; the engine keeps the reader
     (`lora_loader`) for adapters loaded at run time.
  5. With `kv_events_endpoint`, the KV event publisher's sockets are set up
     first (a busy endpoint is a `BindError` before anything loads) and every
     member engine publishes through it under its own `data_parallel_rank`
     (serving/engine/kv_events.py).
With several processes (`jax.distributed`), `start_multihost` does the same
in lock-step: process 0 gets the engine, the others follow its steps.

Before anything loads, `check_setup` checks what can be checked from the names
and the options alone (the model and draft model can be found and read, the
devices the layout asks for are visible) and raises `SetupError`
(serving/entrypoints/startup.py), as do the later checks that are the input's
fault (a draft model with another tokenizer, options that do not go together).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import zmq

import checkpoints
import sharding
from checkpoints import load_quantized
from checkpoints.layout import LoadedModel
from checkpoints.lora import load_lora_adapter
from serving.config import EngineConfig
from serving.engine import EngineClient, LLMEngine, Runner
from serving.engine.disaggregated import HYBRID_REFUSAL, DisaggregatedEngine
from serving.engine.kv_disk_store import DiskPageStore, disk_identity
from serving.engine.kv_events import KVEventPublisher, KVEventRecorder
from serving.engine.replicas import ReplicatedEngine
from serving.entrypoints.startup import BindError, SetupError
from serving.models.model_config import ModelConfig
from serving.runner import multihost
from serving.runner.kv_cache import kv_layout
from serving.runner.model_runner import ModelRunner, capacity_pages
from serving.runner.weights import prepare_weights

log = logging.getLogger(__name__)


def load_model(model: str | LoadedModel, config: EngineConfig) -> LoadedModel:
  """The checkpoint on the host (a `LoadedModel` passes through)."""
  if isinstance(model, LoadedModel):
    return model
  method = load_method(model, config.model.quantization)
  if method:  # GGUF blocks of the matching type stay quantized
    return load_quantized(model, method)
  return checkpoints.load_checkpoint(model)


def load_method(model: str, quantization: str | None) -> str | None:
  """The quantization `model` loads with: "auto" is "gguf" for a GGUF file (its blocks
  served as stored: one set of weights for every batch size) and None (as loaded) for
  any other checkpoint."""
  if quantization != "auto":
    return quantization
  return "gguf" if checkpoints.checkpoint_format(model) == "gguf" else None


def check_model(model: str | LoadedModel, quantization: str | None = None) -> None:
  """SetupError unless `model` names a checkpoint that loads (with `quantization`), found
  without reading any weights."""
  if isinstance(model, LoadedModel):
    return
  try:
    checkpoints.checkpoint_format(model, load_method(model, quantization))
  except (FileNotFoundError, ValueError) as e:
    raise SetupError(str(e)) from e


def check_setup(model: str | LoadedModel, config: EngineConfig) -> None:
  """SetupError when `build_engine(model, config)` cannot work, found before anything loads:
  the model (and the draft model) and the devices the layout needs."""
  check_model(model, config.model.quantization)
  if config.speculative.speculative_method == "draft":
    check_model(config.speculative.speculative_model, config.model.quantization)
  if config.parallel.kv_role != "both" and jax.process_count() > 1:
    raise SetupError(f"kv_role={config.parallel.kv_role!r} serves from one process: with "
                     "several processes per server, use kv_role 'both'")
  if config.parallel.disaggregated or config.parallel.dp > 1:
    if jax.process_count() > 1:
      raise SetupError("dp replicas and prefill / decode workers run in one process; with "
                       "several processes start one server per host and balance across them")
    if config.parallel.disaggregated and config.speculative.speculative_method == "draft":
      raise SetupError("a draft model is not supported with prefill / decode workers yet; use "
                       "speculative_method='ngram' or 'suffix'")
  if config.parallel.disaggregated:
    worker_device_groups(config)
  else:
    replica_devices(config)


def build_engine(model: str | LoadedModel, config: EngineConfig, *,
                 wrap_runner: Callable[[ModelRunner], Runner] | None = None,
                 lora_modules: Mapping[str, str] | None = None
                 ) -> EngineClient:
  """A single-controller engine over all the devices `config` asks for.

  `wrap_runner` puts another `Runner` around the model's (the benchmark's step
  timer, the tests' fault injection). `lora_modules`: adapter name -> PEFT
  directory, registered before the engine is returned (needs `max_loras`).
  With `dp` > 1: `dp` engine replicas, each on its own `tp * ep * pp` devices, behind
  one router (serving/engine/replicas.py); the checkpoint is read once. Input that
  cannot be served raises `SetupError` before anything loads (`check_setup`).
  """
  check_setup(model, config)
  publisher = kv_event_publisher(config)
  try:
    loaded = load_model(model, config)
    draft = load_draft(loaded, config)
    name = _model_name(model, loaded)
    if config.parallel.disaggregated:
      engine = build_disaggregated(loaded, config, name, wrap_runner)  # no draft (check_setup)
    elif config.parallel.dp > 1:
      engine = build_replicas(loaded, config, name, draft, wrap_runner)
    else:
      runner = ModelRunner(prepare_weights(loaded.params, loaded.config, config, draft=draft),
                           kv_transfer=config.parallel.kv_role != "both")
      engine = _engine(loaded, config, name, runner, wrap_runner)
  except BaseException:
    if publisher is not None:
      publisher.close()
    raise
  if publisher is not None:
    attach_kv_events(engine, publisher, config)
  register_loras(engine, lora_modules)
  return engine


def kv_event_publisher(config: EngineConfig) -> KVEventPublisher | None:
  """The KV event publisher `config` asks for, its sockets set up (not yet sending), or
  None; BindError when an endpoint cannot be bound."""
  cache = config.cache
  if cache.kv_events_endpoint is None:
    return None
  try:
    return KVEventPublisher(cache.kv_events_endpoint, topic=cache.kv_events_topic,
                            replay_endpoint=cache.kv_events_replay_endpoint,
                            fmt=cache.kv_events_format)
  except zmq.ZMQError as e:
    endpoints = ", ".join(f"{k}={v}" for k, v in (
        ("--kv_events_endpoint", cache.kv_events_endpoint),
        ("--kv_events_replay_endpoint", cache.kv_events_replay_endpoint)) if v)
    raise BindError(f"{endpoints}: cannot set up the KV event sockets: {e}") from None


def attach_kv_events(engine: EngineClient, publisher: KVEventPublisher,
                     config: EngineConfig) -> None:
  """Every member engine records its prefix cache's events for `publisher`, under its
  index among the members (`replica_stats` order) as `data_parallel_rank`; then the
  publisher starts sending."""
  if isinstance(engine, ReplicatedEngine):
    members = list(engine.replicas)
  elif isinstance(engine, DisaggregatedEngine):
    members = engine.engines
  else:
    members = [engine]
  for rank, member in enumerate(members):
    member.attach_kv_events(KVEventRecorder(publisher, block_size=config.cache.page_size,
                                            data_parallel_rank=rank,
                                            lora_names=member.lora_name))
  publisher.start()


def _engine(loaded: LoadedModel, config: EngineConfig, model_name: str, runner: ModelRunner,
            wrap_runner: Callable[[ModelRunner], Runner] | None, member: str = "") -> LLMEngine:
  """`member`: which of several engines in this process this is ("" for the only one):
  its disk tier gets its own subdirectory."""
  return LLMEngine(runner=wrap_runner(runner) if wrap_runner else runner,
                   tokenizer=loaded.tokenizer, config=config, model_name=model_name,
                   lora_loader=lora_loader(loaded.config, config),
                   kv_disk=kv_disk_store(loaded, config, model_name, runner, member))


def kv_disk_store(loaded: LoadedModel, config: EngineConfig, model_name: str,
                  runner: ModelRunner, member: str = "") -> DiskPageStore | None:
  """The disk tier of the tiered prefix cache (`kv_offload_disk_dir`), keyed by what the
  runner's pages are (model, architecture, page size, KV dtype, page layout, tp); None
  when it is off."""
  cache = config.cache
  if cache.kv_offload_disk_dir is None:
    return None
  layout = ",".join(f"{list(shape)}:{dtype}" for shape, dtype in runner.kv_page_specs())
  identity = disk_identity(model=model_name, model_config=loaded.config, engine_config=config,
                           kv_dtype=runner.kv_dtype_name, layout=f"k,v {layout}")
  directory = os.path.join(cache.kv_offload_disk_dir, member) if member else \
      cache.kv_offload_disk_dir
  return DiskPageStore(directory, int(cache.kv_offload_disk_gb * 2**30), identity)


def replica_devices(config: EngineConfig, devices: Sequence[Any] | None = None
                    ) -> list[list[Any]]:
  """The device group of each of the `dp` replicas: consecutive `tp * ep * pp` devices
  (SetupError when there are too few)."""
  devices = list(jax.devices() if devices is None else devices)
  par = config.parallel
  per = par.devices_per_engine
  if par.dp * per > len(devices):
    layout = (f"dp={par.dp} replicas of tp*ep*pp={per} devices need" if par.dp > 1
              else f"tp*ep*pp = {par.tp}*{par.ep}*{par.pp} needs")
    raise SetupError(f"{layout} {par.dp * per} devices but only {len(devices)} are visible "
                     f"({devices[0].platform}; on CPU set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={par.dp * per})")
  return [devices[i * per:(i + 1) * per] for i in range(par.dp)]


def build_replicas(loaded: LoadedModel, config: EngineConfig, model_name: str,
                   draft: tuple[dict, ModelConfig] | None,
                   wrap_runner: Callable[[ModelRunner], Runner] | None) -> ReplicatedEngine:
  """`dp` whole engines, one per device group, each with dp=1 and its own mesh."""
  replica_cfg = config.replace(dp=1)
  engines = [_engine_on(loaded, replica_cfg, model_name, devices, draft, wrap_runner,
                        f"replica {i} of {config.parallel.dp}")
             for i, devices in enumerate(replica_devices(config))]
  return ReplicatedEngine(engines, config=config)


def _engine_on(loaded: LoadedModel, config: EngineConfig, model_name: str,
               devices: Sequence[Any], draft: tuple[dict, ModelConfig] | None,
               wrap_runner: Callable[[ModelRunner], Runner] | None, label: str,
               plain_single_device: bool = False, kv_transfer: bool = False) -> LLMEngine:
  """One engine on its own device group (a mesh over `devices`), and its capacity line.
  `plain_single_device`: a group of just the default device runs without a mesh, as
  one engine does (unrolled layers, a dense copy beside quantized weights)."""
  mesh = sharding.make_mesh(sharding.ParallelConfig.of(config.parallel), devices)
  if plain_single_device and list(devices) == jax.devices()[:1]:
    mesh = None
  weights = prepare_weights(loaded.params, loaded.config, config, mesh=mesh, draft=draft)
  runner = ModelRunner(weights, kv_transfer=kv_transfer)
  engine = _engine(loaded, config, model_name, runner, wrap_runner,
                   member=label.replace(" ", "-"))
  tokens = (runner.num_pages - 1) * config.cache.page_size
  msg = (f"{label} on {', '.join(str(d) for d in devices)}: {tokens} KV "
         f"tokens, max concurrency at max_model_len={config.scheduler.max_model_len}: "
         f"{tokens / config.scheduler.max_model_len:.1f} requests")
  print(msg, file=sys.stderr, flush=True)
  return engine


def build_disaggregated(loaded: LoadedModel, config: EngineConfig, model_name: str,
                        wrap_runner: Callable[[ModelRunner], Runner] | None
                        ) -> DisaggregatedEngine:
  """`prefill_workers` + `decode_workers` engines, each on its own `tp * ep * pp` devices
  (serving/engine/disaggregated.py). On CPU, with fewer devices than that, the engines
  share them (each with its share of the KV memory budget)."""
  par = config.parallel
  if kv_layout(loaded.config, config, 2) is not None:  # before any worker is placed
    raise SetupError(HYBRID_REFUSAL)
  n = par.prefill_workers + par.decode_workers
  groups = worker_device_groups(config)
  worker_cfg = config.replace(prefill_workers=0, decode_workers=0, enable_prefix_caching=True)
  if n * par.devices_per_engine > len(jax.devices()):  # the groups share devices
    # One memory budget split n ways, sized once: every worker gets the same KV pool
    # (and so the same programs: the second loads what the first compiled).
    worker_cfg = worker_cfg.replace(
        kv_cache_memory_fraction=config.cache.kv_cache_memory_fraction / n)
    if worker_cfg.cache.num_pages is None:
      worker_cfg = worker_cfg.replace(num_pages=capacity_pages(loaded.config, worker_cfg))
  engines = [_engine_on(loaded, worker_cfg, model_name, group, None, wrap_runner,
                        f"{'prefill' if i < par.prefill_workers else 'decode'} worker "
                        f"{i if i < par.prefill_workers else i - par.prefill_workers}",
                        plain_single_device=True, kv_transfer=True)
             for i, group in enumerate(groups)]
  return DisaggregatedEngine(engines[:par.prefill_workers],
                             engines[par.prefill_workers:], config=config)


def worker_device_groups(config: EngineConfig, devices: Sequence[Any] | None = None
                         ) -> list[list[Any]]:
  """The device group of each prefill / decode worker: consecutive `tp * ep * pp` devices;
  on CPU, with fewer devices than that, the groups share them (SetupError elsewhere)."""
  devices = list(jax.devices() if devices is None else devices)
  par = config.parallel
  n = par.prefill_workers + par.decode_workers
  per = par.devices_per_engine
  if n * per <= len(devices):
    return [devices[i * per:(i + 1) * per] for i in range(n)]
  if devices[0].platform != "cpu" or per > len(devices):
    raise SetupError(f"{par.prefill_workers} prefill + {par.decode_workers} decode "
                     f"workers of tp*ep*pp={per} devices need {n * per} devices but only "
                     f"{len(devices)} are visible")
  return [devices[(i * per) % len(devices):][:per] for i in range(n)]


def load_draft(target: LoadedModel, config: EngineConfig) -> tuple[dict, ModelConfig] | None:
  """The draft model's (params, config) for speculative_method="draft", else None.

  It must speak the target's tokenizer: the same ids for the same text (checked
  on a probe text) and no ids beyond the target's vocabulary.
  """
  if config.speculative.speculative_method != "draft":
    return None
  draft = load_model(config.speculative.speculative_model, config)
  probe = "Speculative decoding: 12 + 30 = 42, naïve café — def f(x): return x"
  if (draft.tokenizer.encode(probe, add_special_tokens=False)
      != target.tokenizer.encode(probe, add_special_tokens=False)):
    raise SetupError(f"speculative_model {config.speculative.speculative_model!r} does not use "
                     "the target model's tokenizer (the same text gives other token ids)")
  log.info("draft model %s: %d layers, vocabulary %d", config.speculative.speculative_model,
           draft.config.num_layers, draft.config.vocab_size)
  return draft.params, draft.config


def lora_loader(model_cfg: ModelConfig, config: EngineConfig
                ) -> Callable[[str], tuple[int, Any]] | None:
  """path -> (rank, validated weights) for this model, or None when LoRA is off."""
  if not config.lora.max_loras:
    return None

  def load(path: str) -> tuple[int, Any]:
    weights = load_lora_adapter(path, model_cfg, max_rank=config.lora.max_lora_rank)
    return weights.rank, weights

  return load


def register_loras(engine: EngineClient,
                   lora_modules: Mapping[str, str] | None) -> None:
  """Reads and registers each adapter; any failure raises (a server must not start
  without an adapter it was told to serve)."""
  if lora_modules and not engine.config.lora.max_loras:
    raise SetupError("lora_modules need max_loras >= 1 (LoRA slots on the device)")
  for name, path in (lora_modules or {}).items():
    engine.load_lora(name, path)


def start_multihost(model: str | LoadedModel, config: EngineConfig) -> LLMEngine | None:
  """Every process calls this after `jax.distributed` start-up: process 0 gets the
  engine (its runner announces each step), the others run the steps until process 0
  shuts its engine down, then get None."""
  devices = sharding.ParallelConfig.of(config.parallel).num_devices
  if devices != len(jax.devices()):
    raise SetupError(f"tp*ep*dp*pp = {devices} must equal the {len(jax.devices())} devices of all "
                     f"{jax.process_count()} processes (one global mesh runs every step)")
  if config.cache.kv_offload_host_gb:
    raise SetupError("the tiered prefix cache (kv_offload_host_gb) is not supported with "
                     "several processes yet")
  if config.lora.max_loras:
    raise SetupError("LoRA adapters are not supported with several processes yet "
                     "(max_loras must be 0)")
  if config.speculative.speculative_method == "draft":
    raise SetupError("a draft model is not supported with several processes yet; use "
                     "speculative_method='ngram' or 'suffix'")
  if config.cache.kv_events_endpoint is not None:
    raise SetupError("KV events are not published with several processes yet "
                     "(kv_events_endpoint must be unset)")
  check_model(model, config.model.quantization)
  loaded = load_model(model, config)
  config = multihost.agree_config(loaded.config, config)
  runner = ModelRunner(prepare_weights(loaded.params, loaded.config, config))
  if jax.process_index() == 0:
    return LLMEngine(runner=multihost.LeaderRunner(runner), tokenizer=loaded.tokenizer,
                     config=config, model_name=_model_name(model, loaded))
  runner.warm_up()
  calls = multihost.follower_loop(runner)
  log.info("follower %d: leader stopped after %d device calls", jax.process_index(), calls)
  return None


def _model_name(model: str | LoadedModel, loaded: LoadedModel) -> str:
  return model if isinstance(model, str) else loaded.source
