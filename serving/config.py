"""Engine configuration: static knobs in small frozen groups, validated once.

`EngineConfig` composes one group per concern, each a frozen dataclass that
checks its own fields (in the spirit of vLLM's `VllmConfig`):

  model        ModelOptions        compute / weight / KV dtypes, quantization, attention backend
  cache        CacheOptions        KV pages: size, count, memory share, dtype, prefix caching
  scheduler    SchedulerOptions    batch and length limits, compiled buckets, multi-step decode
  parallel     ParallelOptions     tp / ep / dp / pp, disaggregated prefill and decode workers
  speculative  SpeculativeOptions  proposer, drafts per step, back-off batch size
  lora         LoraOptions         adapter slots and their rank
  cpu          CpuKernelOptions    the native CPU kernels' knobs
  compilation  CompilationOptions  the on-disk cache of compiled programs

Users never see the groups: every field keeps the name of its launcher flag
and `LLM(...)` keyword (`page_size`, `max_num_seqs`, ...), unique across the
groups, and `EngineConfig.of(**options)` builds a config from those flat names
(`OPTION_GROUPS` says which group holds each). Checks that span two groups
(e.g. `page_size` must divide `max_model_len`) live in `EngineConfig`.
Shapes compiled by the runner (decode batch buckets, prefill token buckets,
the block-table width) are all derived here, so the set of compiled programs
is a pure function of this config.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

ATTENTION_BACKENDS = ("auto", "xla", "pallas", "pallas_interpret")
DTYPES = ("auto", "float32", "bfloat16")
# "auto": a GGUF file's blocks as stored ("gguf"), any other checkpoint as loaded (None).
QUANTIZATIONS = (None, "auto", "int8", "int4", "fp8", "gguf")
CPU_ACTIVATION_BITS = (32, 16, 8)  # CpuKernelOptions.cpu_activation_bits
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8")
SPECULATIVE_METHODS = ("none", "ngram", "suffix", "draft")
KV_EVENTS_FORMATS = ("array", "map")  # serving/engine/kv_events.py EVENT_FORMATS
KV_EVENTS_SCHEMES = ("tcp://", "ipc://", "inproc://")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
  """Powers of two from `lo` up to `hi`; `hi` itself is always the last bucket."""
  out, b = [], lo
  while b < hi:
    out.append(b)
    b *= 2
  out.append(hi)
  return tuple(sorted(set(out)))


def capped_buckets(buckets, cap: int) -> tuple[int, ...]:
  """Chosen buckets below `cap`, sorted, with `cap` itself always the last (a preset's
  list stays valid when a smaller or larger cap is asked for)."""
  chosen = tuple(int(b) for b in buckets)
  if any(b < 1 for b in chosen):
    raise ValueError(f"buckets {chosen} must all be at least 1")
  return tuple(sorted({b for b in chosen if b < cap} | {cap}))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
  """Smallest bucket >= n; raises if n exceeds the largest."""
  for b in buckets:
    if b >= n:
      return b
  raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def default_max_loras(num_adapters: int) -> int:
  """LoRA slots when adapters are given but `max_loras` is not: one each, at most 4."""
  return max(1, min(num_adapters, 4))


# Engine options for serving on each platform where the user and the model's preset set
# none (`platform_defaults`): the same for every model, chosen for the machine kind.
_CPU_DEFAULTS = {
    # A decode call's host work (schedule, dispatch, fetch: ~1 ms) is a large share of a
    # small model's step on CPU; four decode iterations per call pay it once
    # (docs/multi_step.md). Larger models' steps take longer and lose nothing: the
    # multi-step call runs only while no request waits.
    "num_decode_steps": 4,
    # Each compiled program holds 10-75 MB of host memory on XLA:CPU: fewer buckets
    # than powers of two from 1 / 16 (a prompt padded to 64 tokens costs little more).
    "prefill_buckets": (64, 128, 256, 512, 1024, 2048, 4096, 8192),
    "decode_buckets": (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
}


def platform_defaults(platform: str) -> dict:
  """Engine options a server on `platform` ("cpu", "tpu", "gpu") uses unless the model's
  preset or the user sets them (`merge_engine_options`)."""
  return dict(_CPU_DEFAULTS) if platform == "cpu" else {}


def expected_platform() -> str:
  """The platform jax will pick ("cpu", "gpu", "tpu"), found without starting a backend
  (engine options are resolved before `jax.distributed` starts, which must come first):
  $JAX_PLATFORMS' first entry, else "tpu" / "gpu" where their plugin is installed."""
  chosen = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
  if chosen:
    return "gpu" if chosen in ("cuda", "rocm") else chosen
  if importlib.util.find_spec("libtpu") is not None:
    return "tpu"
  if any(importlib.util.find_spec(f"jax_{kind}_plugin") is not None
         for kind in ("cuda12", "cuda13", "rocm7")):
    return "gpu"
  return "cpu"


def merge_engine_options(preset: dict, given: dict, platform: str | None = None) -> dict:
  """A model preset's engine options overridden by the ones given (LLM kwargs, flags),
  over the `platform_defaults` of `platform` (None: none).

  An explicit `dtype` without a `weight_dtype` also takes the weights: the
  preset's `weight_dtype` is dropped (back to "auto", which follows `dtype`),
  so `dtype="float32"` never leaves bfloat16 weights behind.
  """
  merged = {**(platform_defaults(platform) if platform else {}), **preset, **given}
  if "dtype" in given and "weight_dtype" not in given:
    merged.pop("weight_dtype", None)
  return merged


def default_cache_dir() -> str:
  return os.environ.get(
      "XLASERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "jax"))


def _check_at_least(group, names: tuple[str, ...], low: int) -> None:
  for name in names:
    if getattr(group, name) < low:
      raise ValueError(f"{name}={getattr(group, name)} must be at least {low}")


def _check_choice(name: str, value, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r} not in {choices}")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """How the model's weights are stored and computed."""

  dtype: str = "auto"
  weight_dtype: str = "auto"  # "auto": as dtype; bfloat16 under float32 compute halves bytes
  quantization: str | None = "auto"  # None: dequantize a GGUF; "auto": QUANTIZATIONS
  attention_backend: str = "auto"
  unroll_layers: bool | None = None  # None: unrolled on CPU, scanned on TPU/GPU

  def __post_init__(self):
    _check_choice("dtype", self.dtype, DTYPES)
    _check_choice("weight_dtype", self.weight_dtype, DTYPES)
    _check_choice("quantization", self.quantization, QUANTIZATIONS)
    _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)


@dataclasses.dataclass(frozen=True)
class CacheOptions:
  """The paged KV cache."""

  page_size: int = 16
  num_pages: int | None = None  # None: sized from kv_cache_memory_fraction
  kv_cache_memory_fraction: float = 0.3
  kv_cache_dtype: str = "auto"
  enable_prefix_caching: bool = True
  attention_block_tokens: int = 128  # keys per step of the XLA attention loop
  # Tiered prefix cache (serving/engine/kv_offload.py): evicted prefix pages are kept in a
  # host pool of this many GiB (0: off) and, past it, in files under `kv_offload_disk_dir`
  # (at most `kv_offload_disk_gb` GiB); a prefix hit in a tier reloads them.
  kv_offload_host_gb: float = 0.0
  kv_offload_disk_dir: str | None = None
  kv_offload_disk_gb: float = 0.0
  # KV-cache events (docs/kv_events.md): a ZMQ PUB endpoint (None: off), the topic frame,
  # an optional replay ROUTER endpoint, and the events' msgpack shape.
  kv_events_endpoint: str | None = None
  kv_events_topic: str = ""
  kv_events_replay_endpoint: str | None = None
  kv_events_format: str = "array"

  def __post_init__(self):
    _check_at_least(self, ("page_size",), 1)
    self._check_kv_events()
    self._check_offload()
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(f"num_pages={self.num_pages} must be at least 2 (one is reserved)")
    if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
      raise ValueError(
          f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} must be in (0, 0.95]")
    _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
    if self.attention_block_tokens % self.page_size:
      raise ValueError(f"page_size={self.page_size} must divide attention_block_tokens="
                       f"{self.attention_block_tokens}")

  def _check_offload(self) -> None:
    if self.kv_offload_host_gb < 0 or self.kv_offload_disk_gb < 0:
      raise ValueError(f"kv_offload_host_gb={self.kv_offload_host_gb} and kv_offload_disk_gb="
                       f"{self.kv_offload_disk_gb} must be >= 0")
    if (self.kv_offload_disk_dir is not None) != (self.kv_offload_disk_gb > 0):
      raise ValueError(f"kv_offload_disk_dir={self.kv_offload_disk_dir!r} and "
                       f"kv_offload_disk_gb={self.kv_offload_disk_gb} go together")
    if self.kv_offload_disk_dir is not None and self.kv_offload_host_gb == 0:
      raise ValueError("the disk tier (kv_offload_disk_dir) is reloaded through the host "
                       "tier: set kv_offload_host_gb too")

  def host_tier_pages(self, page_bytes: int) -> int:
    """KV pages of `page_bytes` (every layer's K and V) the host tier holds."""
    return int(self.kv_offload_host_gb * 2**30 // page_bytes)

  def _check_kv_events(self) -> None:
    _check_choice("kv_events_format", self.kv_events_format, KV_EVENTS_FORMATS)
    for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
      value = getattr(self, name)
      if value is not None and not value.startswith(KV_EVENTS_SCHEMES):
        raise ValueError(f"{name}={value!r} must start with one of {KV_EVENTS_SCHEMES}")
    if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
      raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
  """What one step may hold, the shapes compiled for it, and the engine loop's limits."""

  max_num_seqs: int = 32
  max_model_len: int = 2048
  max_num_batched_tokens: int = 512
  # Shapes compiled: each bucket is one program (each loaded XLA:CPU program holds
  # 10-75 MB of host memory, docs/performance.md), so presets may pick fewer. Entries
  # above the cap are dropped and the cap itself is always the last bucket.
  prefill_buckets: tuple[int, ...] | None = None  # None: powers of two from 16
  decode_buckets: tuple[int, ...] | None = None  # None: powers of two from 1
  # Multi-step decoding (vLLM's num_scheduler_steps): while only decode rows run, no
  # request waits and at most `decode_steps_max_batch` rows decode, one device call
  # runs `num_decode_steps` decode + sample iterations, each row taking the token it
  # sampled last; the host's per-step work (schedule, dispatch, fetch) is paid once
  # per call. 1: off. docs/multi_step.md.
  num_decode_steps: int = 1
  decode_steps_max_batch: int = 8
  seed: int | None = None  # for requests without a seed; None: a fresh one per process
  step_timeout_s: float = 120.0  # a step running longer means a wedged device: unhealthy

  def __post_init__(self):
    _check_at_least(self, ("max_num_seqs", "max_model_len", "max_num_batched_tokens",
                           "decode_steps_max_batch"), 1)
    if not 1 <= self.num_decode_steps <= 16:
      raise ValueError(f"num_decode_steps={self.num_decode_steps} must be in [1, 16]")
    if not self.step_timeout_s > 0:
      raise ValueError(f"step_timeout_s={self.step_timeout_s} must be positive")
    if self.prefill_buckets is not None:
      object.__setattr__(self, "prefill_buckets",
                         capped_buckets(self.prefill_buckets, self.max_num_batched_tokens))
    if self.decode_buckets is not None:
      object.__setattr__(self, "decode_buckets",
                         capped_buckets(self.decode_buckets, self.max_num_seqs))

  @property
  def prefill_token_buckets(self) -> tuple[int, ...]:
    """Token counts a prefill chunk is padded to."""
    if self.prefill_buckets:
      return self.prefill_buckets
    return pow2_buckets(min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)

  @property
  def decode_batch_buckets(self) -> tuple[int, ...]:
    """Row counts the decode slot batch is padded to."""
    if self.decode_buckets:
      return self.decode_buckets
    return pow2_buckets(1, self.max_num_seqs)

  def prefill_chunk_rows(self, tokens: int) -> int:
    """Chunks a prefill call of `tokens` (a bucket) holds: one per 16 tokens (its
    padded logits rows then cost under 1/16 of the call), up to max_num_seqs, as a
    decode batch bucket (whose sampler it shares)."""
    return bucket_for(min(self.max_num_seqs, max(1, tokens // 16)), self.decode_batch_buckets)

  def decode_buckets_up_to(self, rows: int) -> tuple[int, ...]:
    """The decode batch buckets a batch of at most `rows` rows is padded to."""
    cap = min(rows, self.max_num_seqs)
    return tuple(b for b in self.decode_batch_buckets if b < cap) + (
        bucket_for(cap, self.decode_batch_buckets),)

  @property
  def multi_step_batch_buckets(self) -> tuple[int, ...]:
    """Row counts a multi-step decode call is padded to (none when it is off)."""
    if self.num_decode_steps == 1:
      return ()
    return self.decode_buckets_up_to(self.decode_steps_max_batch)


KV_ROLES = ("both", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
  """Devices and engines: mesh axis sizes, disaggregated prefill / decode workers."""

  tp: int = 1
  ep: int = 1
  dp: int = 1
  pp: int = 1  # pipeline stages (sharding/pipeline.py)
  # Disaggregated serving (serving/engine/disaggregated.py): engines that only prefill
  # and engines that decode, KV pages moved from the first to the second.
  prefill_workers: int = 0
  decode_workers: int = 0
  kv_transfer_pages: int = 8  # pages per transfer chunk
  # Cross-process prefill / decode (serving/engine/kv_transfer.py): this server offers its
  # prompts' KV pages ("prefill"), pulls them from a prefill server ("decode"), or neither.
  kv_role: str = "both"

  def __post_init__(self):
    _check_at_least(self, ("tp", "ep", "dp", "pp"), 1)
    if self.kv_role not in KV_ROLES:
      raise ValueError(f"kv_role={self.kv_role!r} must be one of {KV_ROLES}")
    if self.kv_role != "both" and (self.prefill_workers or self.dp > 1):
      raise ValueError(f"kv_role={self.kv_role!r} serves one engine: it cannot be combined "
                       "with dp replicas or in-process prefill_workers / decode_workers")
    for name in ("prefill_workers", "decode_workers"):
      if not 0 <= getattr(self, name) <= 64:
        raise ValueError(f"{name}={getattr(self, name)} must be in [0, 64]")
    if (self.prefill_workers > 0) != (self.decode_workers > 0):
      raise ValueError("disaggregated serving needs both prefill_workers >= 1 and "
                       f"decode_workers >= 1 (got {self.prefill_workers} and "
                       f"{self.decode_workers})")
    if self.prefill_workers and self.dp > 1:
      raise ValueError("prefill_workers / decode_workers replace dp: scale each role by its "
                       "worker count")
    if not 1 <= self.kv_transfer_pages <= 1024:
      raise ValueError(f"kv_transfer_pages={self.kv_transfer_pages} must be in [1, 1024]")

  @property
  def disaggregated(self) -> bool:
    """Prefill and decode run on separate engines (prefill_workers / decode_workers)."""
    return self.prefill_workers > 0

  @property
  def devices_per_engine(self) -> int:
    """Devices one engine (a replica, a prefill or decode worker) runs on: tp * ep * pp."""
    return self.tp * self.ep * self.pp


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
  """Speculative decoding (docs/spec_decode.md): proposer, drafts per step and row."""

  speculative_method: str = "none"  # none | ngram | suffix | draft
  num_speculative_tokens: int = 4  # by measurement (docs/spec_decode.md)
  speculative_model: str | None = None  # the draft model (method "draft"), as --model
  prompt_lookup_min: int = 2  # n-gram sizes the ngram proposer matches
  prompt_lookup_max: int = 5
  # Back-off: no speculation while more requests than this decode (vLLM's
  # disable_by_batch_size); verify programs are compiled up to this batch.
  speculative_max_batch: int = 4

  def __post_init__(self):
    _check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
    if not 1 <= self.num_speculative_tokens <= 16:
      raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
    if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
      raise ValueError(f"need 1 <= prompt_lookup_min={self.prompt_lookup_min} <= "
                       f"prompt_lookup_max={self.prompt_lookup_max} <= 64")
    _check_at_least(self, ("speculative_max_batch",), 1)
    if (self.speculative_method == "draft") != (self.speculative_model is not None):
      raise ValueError("speculative_method='draft' needs a speculative_model, and "
                       "speculative_model is used only with speculative_method='draft'")

  @property
  def enabled(self) -> bool:
    return self.speculative_method != "none"


@dataclasses.dataclass(frozen=True)
class LoraOptions:
  """LoRA adapter slots on the device (docs/lora.md)."""

  max_loras: int = 0  # LoRA adapter slots on the device; 0: LoRA off
  max_lora_rank: int = 16  # every slot's rank; adapters of lower rank are zero-padded

  def __post_init__(self):
    if not 0 <= self.max_loras <= 256:
      raise ValueError(f"max_loras={self.max_loras} must be in [0, 256]")
    if not 1 <= self.max_lora_rank <= 1024:
      raise ValueError(f"max_lora_rank={self.max_lora_rank} must be in [1, 1024]")


@dataclasses.dataclass(frozen=True)
class CpuKernelOptions:
  """The native CPU kernels (kernels_cpu/); ignored where they do not run."""

  # Keep a dequantized (weight_dtype) copy of the quantized weights the native CPU kernel
  # reads: small decode batches read the codes, prefill and large batches the copy (one
  # device only; without such weights, or on a mesh, it changes nothing).
  quantized_dense_copy: bool = False
  # Nibble (Q4) and Q8_0 weights in the native CPU kernel: round the activations per
  # group of 32 to this many bits and multiply with integer dot products (VNNI). 8:
  # llama.cpp's scheme (fastest, ~0.5% of each output's range); 16: 2^-16 of each group's
  # largest activation (the default: on the default model the same greedy tokens as 32);
  # 32: float32 tiles (exact up to summation order, slowest).
  cpu_activation_bits: int = 16
  # Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights with integer activations where the native
  # kernels run on AVX-512 VNNI, with or without AMX (one device): re-laid once at load in
  # the kernels' column-tiled layout, one sequential stream per 16 output channels (same
  # results bitwise; batch-1 decode reads the weights faster). False keeps the stored
  # rows (for comparison).
  cpu_weight_tiles: bool = True

  def __post_init__(self):
    _check_choice("cpu_activation_bits", self.cpu_activation_bits, CPU_ACTIVATION_BITS)


@dataclasses.dataclass(frozen=True)
class CompilationOptions:
  """Compiled programs kept on disk across restarts."""

  compilation_cache: bool = True
  compilation_cache_dir: str = dataclasses.field(default_factory=default_cache_dir)


# EngineConfig's attribute -> the group class it holds.
GROUPS: dict[str, type] = {
    "model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions,
    "parallel": ParallelOptions, "speculative": SpeculativeOptions, "lora": LoraOptions,
    "cpu": CpuKernelOptions, "compilation": CompilationOptions,
}
# Every flat option name (a launcher flag and an `LLM(...)` keyword) -> its group.
OPTION_GROUPS: dict[str, str] = {
    f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine options, one frozen group per concern (the module docstring)."""

  model: ModelOptions = dataclasses.field(default_factory=ModelOptions)
  cache: CacheOptions = dataclasses.field(default_factory=CacheOptions)
  scheduler: SchedulerOptions = dataclasses.field(default_factory=SchedulerOptions)
  parallel: ParallelOptions = dataclasses.field(default_factory=ParallelOptions)
  speculative: SpeculativeOptions = dataclasses.field(default_factory=SpeculativeOptions)
  lora: LoraOptions = dataclasses.field(default_factory=LoraOptions)
  cpu: CpuKernelOptions = dataclasses.field(default_factory=CpuKernelOptions)
  compilation: CompilationOptions = dataclasses.field(default_factory=CompilationOptions)

  def __post_init__(self):
    for name, cls in GROUPS.items():
      if not isinstance(getattr(self, name), cls):
        raise TypeError(f"EngineConfig.{name} must be a {cls.__name__}")
    if self.scheduler.max_model_len % self.cache.page_size:
      raise ValueError(f"page_size={self.cache.page_size} must divide max_model_len="
                       f"{self.scheduler.max_model_len}")

  @classmethod
  def of(cls, **options) -> EngineConfig:
    """A config from flat option names (the launcher's flags, `LLM(...)` keywords);
    options not given keep their defaults. TypeError names an unknown option."""
    unknown = sorted(set(options) - set(OPTION_GROUPS))
    if unknown:
      raise TypeError(f"unknown engine options {unknown}")
    grouped: dict[str, dict] = {name: {} for name in GROUPS}
    for name, value in options.items():
      grouped[OPTION_GROUPS[name]][name] = value
    return cls(**{name: GROUPS[name](**kw) for name, kw in grouped.items()})

  def options(self) -> dict:
    """Every option by its flat name (the inverse of `of`)."""
    return {name: getattr(getattr(self, group), name) for name, group in OPTION_GROUPS.items()}

  def replace(self, **options) -> EngineConfig:
    """A copy with the given flat options changed (validated again)."""
    return EngineConfig.of(**{**self.options(), **options})

  @property
  def max_pages_per_seq(self) -> int:
    return self.scheduler.max_model_len // self.cache.page_size

  @property
  def block_table_width(self) -> int:
    """Pages per block table: max_model_len, rounded up to whole attention blocks."""
    per_block = self.cache.attention_block_tokens // self.cache.page_size
    return -(-self.max_pages_per_seq // per_block) * per_block

  @property
  def verify_batch_buckets(self) -> tuple[int, ...]:
    """Row counts a speculative step is padded to (none when speculation is off)."""
    if not self.speculative.enabled:
      return ()
    return self.scheduler.decode_buckets_up_to(self.speculative.speculative_max_batch)
